//! The kernels' own source run on the CPU: `kernels/*.cu` and each program's fused chains,
//! compiled by the host C++ compiler against `tests/cuda_emu/cuda_emu.h` (each CUDA thread a
//! fiber, barriers and warp shuffles waited for, f16/bf16 rounded as the device rounds) into a
//! library this file loads, and launched with a plan's grid, block and arguments over aligned
//! copies of the plan's memory. Where the interpreter (`interp.rs`, `more.rs`) says what a kernel
//! should compute, this runs what it does compute: the block and warp reductions, the vector
//! accesses, the grid-stride and split walks, at the launch configuration the plan chose.
//!
//! The compiler is `$CXX` or `g++`; the libraries are cached under the tests' target folder by a
//! hash of their sources.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use mpc_runtime::cuda::nvrtc::{COMMON, FAMILIES};
use mpc_runtime::cuda::plan::{Arg, Buf, Kernel, LaunchPlan, Window3};
use mpc_runtime::program::Region;

use super::interp::Memory;

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    *mut *mut c_void,
    i32,
    *const u64,
    *mut c_char,
    u64,
) -> i32;

/// One loaded library of emulated kernels.
pub(crate) struct Library {
    _lib: libloading::Library,
    launch: LaunchFn,
}

/// The kernel families and one program's fused chains.
#[derive(Clone)]
pub(crate) struct Kernels {
    families: &'static Library,
    fused: Option<Arc<Library>>,
}

fn emu_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emu")
}

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "g++".into())
}

fn fnv(parts: &[&str]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for p in parts {
        for b in p.bytes().chain([0]) {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    h
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e} (the emulated kernels need a C++ compiler)"));
    assert!(out.status.success(), "{cmd:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The `extern "C"` kernels a preprocessed unit defines.
fn kernel_names(preprocessed: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = preprocessed;
    while let Some(at) = rest.find("extern \"C\" void") {
        rest = &rest[at + "extern \"C\" void".len()..];
        let name: String = rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        names.push(name);
    }
    names
}

/// Builds (or finds built) the library of these units, `(file stem, source)`, and loads it.
fn build(units: &[(String, String)]) -> Library {
    let header = std::fs::read_to_string(emu_dir().join("cuda_emu.h")).unwrap();
    let launch = std::fs::read_to_string(emu_dir().join("launch.cpp")).unwrap();
    let mut parts = vec![header.as_str(), launch.as_str()];
    parts.extend(units.iter().flat_map(|(n, s)| [n.as_str(), s.as_str()]));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda_emu").join(format!("{:016x}", fnv(&parts)));
    let so = dir.join("kernels.so");
    if !so.exists() {
        static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.with_extension(format!("tmp{}-{build}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let flags = ["-std=c++20", "-O1", "-fPIC", "-w"];
        let include = format!("-I{}", emu_dir().display());
        let mut objects = Vec::new();
        let mut jobs = Vec::new();
        let mut sources: Vec<(PathBuf, PathBuf)> = Vec::new();
        for (stem, source) in units {
            let unit = tmp.join(format!("{stem}.cpp"));
            std::fs::write(&unit, source).unwrap();
            let pre = run(Command::new(compiler()).args(["-std=c++20", "-E", "-P", &include]).arg(&unit));
            let mut reg = format!("#include \"{stem}.cpp\"\n");
            for (i, n) in kernel_names(&pre).iter().enumerate() {
                reg += &format!("static emu::Register r{i}(\"{n}\", &{n});\n");
            }
            let reg_path = tmp.join(format!("{stem}_reg.cpp"));
            std::fs::write(&reg_path, reg).unwrap();
            sources.push((reg_path, tmp.join(format!("{stem}.o"))));
        }
        sources.push((emu_dir().join("launch.cpp"), tmp.join("launch.o")));
        // Two compilers at a time.
        for (src, obj) in sources {
            if jobs.len() == 2 {
                let (mut c, cmd): (std::process::Child, String) = jobs.remove(0);
                assert!(c.wait().unwrap().success(), "{cmd} failed");
            }
            let cmd = format!("{} {} {include} -c {} -o {}", compiler(), flags.join(" "), src.display(), obj.display());
            let child =
                Command::new(compiler()).args(flags).arg(&include).arg("-c").arg(&src).arg("-o").arg(&obj).spawn();
            jobs.push((child.unwrap_or_else(|e| panic!("{cmd}: {e}")), cmd));
            objects.push(obj);
        }
        for (mut c, cmd) in jobs {
            assert!(c.wait().unwrap().success(), "{cmd} failed");
        }
        run(Command::new(compiler()).args(["-shared", "-o"]).arg(tmp.join("kernels.so")).args(&objects));
        // Another test thread may have built the same library meanwhile: either copy will do.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    // SAFETY: the library is the one just built from this crate's own sources; its entry point
    // has the signature of `LaunchFn` (tests/cuda_emu/launch.cpp).
    unsafe {
        let lib = libloading::Library::new(&so).unwrap_or_else(|e| panic!("{}: {e}", so.display()));
        let launch = *lib.get::<LaunchFn>(b"emu_launch\0").unwrap();
        Library { _lib: lib, launch }
    }
}

fn unit(file: &str, source: &str) -> String {
    format!("#include \"cuda_emu.h\"\n#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{file}\"\n{source}\n")
}

fn families() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let units: Vec<(String, String)> =
            FAMILIES.iter().map(|(f, s)| (f.to_string(), unit(&format!("{f}.cu"), s))).collect();
        build(&units)
    })
}

/// The kernels of these plans: the families, and their fused chains in one library.
pub(crate) fn kernels<'a>(plans: impl IntoIterator<Item = &'a LaunchPlan>) -> Kernels {
    static FUSED: OnceLock<Mutex<HashMap<u64, Arc<Library>>>> = OnceLock::new();
    let mut chains: Vec<(String, String)> = Vec::new();
    for p in plans {
        for k in p.kernels() {
            if let Some(f) = &k.fused {
                if !chains.iter().any(|(n, _)| *n == k.name) {
                    chains.push((k.name.clone(), f.source.clone()));
                }
            }
        }
    }
    chains.sort();
    let fused = (!chains.is_empty()).then(|| {
        let all: String = chains.iter().map(|(_, s)| s.as_str()).collect::<Vec<_>>().join("\n");
        let key = fnv(&[&all]);
        let cache = FUSED.get_or_init(Default::default);
        if let Some(l) = cache.lock().unwrap().get(&key) {
            return l.clone();
        }
        let lib = Arc::new(build(&[("fused".to_string(), unit("fused.cu", &all))]));
        cache.lock().unwrap().insert(key, lib.clone());
        lib
    });
    Kernels { families: families(), fused }
}

/// Bytes 16-aligned (the kernels' widest access), copied in and out around a launch.
struct Aligned(Vec<u128>);

impl Aligned {
    fn of(bytes: &[u8]) -> Aligned {
        let mut v = vec![0u128; bytes.len().div_ceil(16)];
        // SAFETY: `v` holds at least `bytes.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len()) };
        Aligned(v)
    }

    fn base(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }

    fn back(&self, bytes: &mut [u8]) {
        // SAFETY: `self` was made from `bytes.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.0.as_ptr() as *const u8, bytes.as_mut_ptr(), bytes.len()) };
    }
}

/// The kernels launched from their source so far in this process, by name (fused chains by
/// their hash).
fn launched() -> &'static Mutex<std::collections::BTreeSet<(bool, String)>> {
    static SEEN: OnceLock<Mutex<std::collections::BTreeSet<(bool, String)>>> = OnceLock::new();
    SEEN.get_or_init(Default::default)
}

/// A line saying how many distinct family kernels and fused chains have run from source so far
/// (the tests run in parallel: the last line printed counts them all).
pub(crate) fn launched_so_far() -> String {
    let seen = launched().lock().unwrap();
    let fused = seen.iter().filter(|(f, _)| *f).count();
    format!("run from their source so far: {} family kernels, {fused} fused chains", seen.len() - fused)
}

/// Prints [`launched_so_far`] when dropped: at the end of a test.
pub(crate) struct Report;

impl Drop for Report {
    fn drop(&mut self) {
        println!("{}", launched_so_far());
    }
}

impl Kernels {
    /// Runs kernel `k` over `m` as its launch configuration says.
    pub(crate) fn launch(&self, k: &Kernel, m: &mut Memory) {
        launched().lock().unwrap().insert((k.fused.is_some(), k.name.clone()));
        let lib = if k.fused.is_some() {
            self.fused.as_deref().expect("a fused kernel without its library")
        } else {
            self.families
        };
        let mut bufs = [&m.arena, &m.state, &m.constants, &m.work, &m.aux, &m.flag].map(|v| Aligned::of(v));
        let bases = bufs.each_mut().map(|b| b.base() as u64);
        let address = |b: Buf| match b {
            Buf::Tensor(Region::Arena, o) => bases[0] + o,
            Buf::Tensor(Region::State, o) => bases[1] + o,
            Buf::Tensor(Region::Constants, o) => bases[2] + o,
            Buf::Work(o) => m.work_in_arena.map_or(bases[3], |at| bases[0] + at) + o,
            Buf::Aux(o) => bases[4] + o,
            Buf::Flag => bases[5],
        };
        for (&at, &b) in &m.addresses {
            let a = address(b).to_le_bytes();
            // SAFETY: the plan's address slots lie inside its aux bytes.
            unsafe { std::ptr::copy_nonoverlapping(a.as_ptr(), bufs[4].base().add(at as usize), 8) };
        }
        let mut storage: Vec<Vec<u64>> = Vec::new();
        let mut sizes: Vec<u64> = Vec::new();
        for a in &k.args {
            let (words, size): (Vec<u64>, usize) = match a {
                Arg::Ptr(b) => (vec![address(*b)], 8),
                Arg::Null => (vec![0], 8),
                Arg::I64(v) => (vec![*v as u64], 8),
                Arg::I32(v) => (vec![*v as u32 as u64], 4),
                Arg::F32(v) => (vec![v.to_bits() as u64], 4),
                Arg::F64(v) => (vec![v.to_bits()], 8),
                Arg::U64(v) => (vec![*v], 8),
                Arg::Dims(d) => (d.iter().map(|&x| x as u64).collect(), 64),
                Arg::Longs3(v) => (v.iter().map(|&x| x as u64).collect(), 24),
                Arg::Longs5(v) => (v.iter().map(|&x| x as u64).collect(), 40),
                Arg::Window(w) => {
                    let n = std::mem::size_of::<Window3>();
                    let mut words = vec![0u64; n.div_ceil(8)];
                    // SAFETY: `Window3` is plain `repr(C)` data of `n` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            w as *const Window3 as *const u8,
                            words.as_mut_ptr() as *mut u8,
                            n,
                        )
                    };
                    (words, n)
                }
            };
            storage.push(words);
            sizes.push(size as u64);
        }
        let mut args: Vec<*mut c_void> = storage.iter_mut().map(|w| w.as_mut_ptr() as *mut c_void).collect();
        let name = CString::new(k.name.as_str()).unwrap();
        let mut err = vec![0u8; 512];
        // SAFETY: every argument points at storage of the size given beside it, which the entry
        // point checks against the kernel's parameters; every address points into `bufs`.
        let rc = unsafe {
            (lib.launch)(
                name.as_ptr(),
                k.grid.as_ptr(),
                k.block.as_ptr(),
                args.as_mut_ptr(),
                args.len() as i32,
                sizes.as_ptr(),
                err.as_mut_ptr() as *mut c_char,
                err.len() as u64,
            )
        };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            panic!("emulated launch: {}", String::from_utf8_lossy(&err[..end]));
        }
        let [arena, state, constants, work, _aux, flag] = &bufs;
        arena.back(&mut m.arena);
        state.back(&mut m.state);
        constants.back(&mut m.constants);
        work.back(&mut m.work);
        flag.back(&mut m.flag);
    }
}
