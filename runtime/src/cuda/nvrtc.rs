//! The kernels of `kernels/`, compiled at run time by NVRTC to a cubin for the device's exact
//! architecture, and cached in memory and on disk (`$XDG_CACHE_HOME/mpc`, else `~/.cache/mpc`)
//! under a key of the NVRTC version, the architecture, the options (but the include folder's
//! path) and the source: a second run compiles nothing. Cubins, not PTX: a newer NVRTC's PTX is refused by an older driver.
//!
//! Each family is compiled as `kernels/common.cuh` followed by the family's file, with `#line`
//! markers so that NVRTC's messages name the right file and line. NVRTC 13 has no built-in fp16 or
//! bf16 headers: the CUDA include folder comes from `MPC_CUDA_INCLUDE`, `CUDA_HOME`, the folders
//! beside the `LD_LIBRARY_PATH` entries (the nvidia-cuda-runtime wheel's layout), or
//! /usr/local/cuda.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as rtc, sys as rtc_sys};

use super::CudaError;

/// Prepended to every family.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel family: its name and source.
pub const FAMILIES: [(&str, &str); 12] = [
    ("elementwise", include_str!("../../../kernels/elementwise.cu")),
    ("casts", include_str!("../../../kernels/casts.cu")),
    ("reduce", include_str!("../../../kernels/reduce.cu")),
    ("softmax", include_str!("../../../kernels/softmax.cu")),
    ("norm", include_str!("../../../kernels/norm.cu")),
    ("pool", include_str!("../../../kernels/pool.cu")),
    ("movement", include_str!("../../../kernels/movement.cu")),
    ("gather", include_str!("../../../kernels/gather.cu")),
    ("loss", include_str!("../../../kernels/loss.cu")),
    ("im2col", include_str!("../../../kernels/im2col.cu")),
    ("train", include_str!("../../../kernels/train.cu")),
    // The attention kernels' warp-level pieces, then the kernels (`#line` keeps NVRTC's
    // messages pointing at each file's own lines). A family's own header is named
    // `<family>_*.cuh`: kernels/check_nvrtc.py finds it by that name.
    (
        "attention",
        concat!(
            "#line 1 \"attention_mma.cuh\"\n",
            include_str!("../../../kernels/attention_mma.cuh"),
            "#line 1 \"attention.cu\"\n",
            include_str!("../../../kernels/attention.cu")
        ),
    ),
];

/// NVRTC's version, or why it cannot be used.
pub fn version() -> Result<(i32, i32), CudaError> {
    // SAFETY: only tries to open the library.
    if !unsafe { rtc_sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; nvrtcVersion writes two ints.
    unsafe { rtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc(format!("{e:?}")))?;
    Ok((major, minor))
}

/// The folder holding `cuda_fp16.h`.
pub fn include_dir() -> Result<PathBuf, CudaError> {
    let has = |d: &Path| d.join("cuda_fp16.h").is_file() && d.join("cuda_bf16.h").is_file();
    let mut candidates: Vec<PathBuf> = Vec::new();
    candidates.extend(std::env::var_os("MPC_CUDA_INCLUDE").map(PathBuf::from));
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        candidates.extend(std::env::var_os(var).map(|h| PathBuf::from(h).join("include")));
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        candidates.extend(std::env::split_paths(&paths).filter_map(|p| Some(p.parent()?.join("include"))));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.into_iter().find(|d| has(d)).ok_or(CudaError::NoHeaders)
}

/// One compiled family: the cubin and NVRTC's log.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub cubin: Arc<Vec<u8>>,
    pub log: String,
    /// Whether it came from the cache (memory or disk) instead of NVRTC.
    pub cached: bool,
}

/// The options every family is compiled with for `arch` (`sm_90`). No multiply and add is
/// contracted into a fused multiply-add (`--fmad=false`): each operation rounds as written, so a
/// chain of element-wise ops fused into one kernel computes the bits of the same ops launched one
/// by one (each rounds its result on store), and the kernels' arithmetic is the CPU's.
/// `fmad` lets NVRTC contract them (its default), to measure what that is worth.
pub fn options(arch: &str, include: &Path, verbose: bool, fmad: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".into(),
        format!("--fmad={fmad}"),
        format!("-I{}", include.display()),
    ];
    if verbose {
        o.push("--ptxas-options=-v".into());
    }
    o
}

/// The source NVRTC compiles for `family`.
pub fn program_source(family: &str, source: &str) -> String {
    format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{family}.cu\"\n{source}")
}

/// FNV-1a, 64 bits: a cache key that stays the same across builds and machines.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x100000001b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("mpc"))
}

fn memory_cache() -> &'static Mutex<HashMap<u64, Arc<Vec<u8>>>> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Arc<Vec<u8>>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Compiles `family` for `arch`, or takes it from the cache. `verbose` asks ptxas for its
/// register and spill report (in the log; a cached cubin has none, so verbose compiles skip the
/// cache).
pub fn compile(family: &str, source: &str, arch: &str, verbose: bool) -> Result<Compiled, CudaError> {
    compile_with(family, source, arch, verbose, false)
}

/// [`compile`], with multiplies and adds contracted into fused multiply-adds where `fmad`.
pub fn compile_with(family: &str, source: &str, arch: &str, verbose: bool, fmad: bool) -> Result<Compiled, CudaError> {
    let nvrtc = version()?;
    let include = include_dir()?;
    let opts = options(arch, &include, verbose, fmad);
    let text = program_source(family, source);
    let v = format!("{}.{}", nvrtc.0, nvrtc.1);
    // The include folder's path is left out of the key: the headers are NVRTC's own version's,
    // wherever they lie, so cubins built on one machine serve another with the same NVRTC.
    let keyed: Vec<&str> = opts.iter().map(String::as_str).filter(|o| !o.starts_with("-I")).collect();
    let key = fnv(&[v.as_bytes(), arch.as_bytes(), keyed.join(" ").as_bytes(), text.as_bytes()]);
    let file = cache_dir().map(|d| d.join(format!("{family}-{arch}-{key:016x}.cubin")));
    if !verbose {
        if let Some(c) = memory_cache().lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(Compiled { cubin: c, log: String::new(), cached: true });
        }
        if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
            let c = Arc::new(bytes);
            if let Ok(mut m) = memory_cache().lock() {
                m.insert(key, c.clone());
            }
            return Ok(Compiled { cubin: c, log: String::new(), cached: true });
        }
    }
    let (cubin, log) = run_nvrtc(family, &text, arch, &opts)?;
    let cubin = Arc::new(cubin);
    if let Ok(mut m) = memory_cache().lock() {
        m.insert(key, cubin.clone());
    }
    if let Some(f) = file {
        // A cache that cannot be written only costs the next run a compile.
        if write_atomic(&f, &cubin).is_ok() {
            if let Some(dir) = f.parent() {
                prune(dir, &format!("{family}-{arch}-"), KEEP_PER_FAMILY);
            }
        }
    }
    Ok(Compiled { cubin, log, cached: false })
}

/// Cubins kept on disk per family and architecture: each build of mpc (or NVRTC version) that
/// compiled one has its own; the oldest beyond these go when a new one is written.
const KEEP_PER_FAMILY: usize = 4;

/// Removes the cubins named `prefix*.cubin` in `dir` but the `keep` most recently written, and
/// temporary files a killed writer left there more than an hour ago. Errors are ignored: a
/// cache that cannot be pruned only takes more disk.
fn prune(dir: &Path, prefix: &str, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut cubins = Vec::new();
    let now = std::time::SystemTime::now();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(modified) = e.metadata().and_then(|m| m.modified()).ok() else { continue };
        if name.starts_with(prefix) && name.ends_with(".cubin") {
            cubins.push((modified, e.path()));
        } else if name.contains(".tmp")
            && now.duration_since(modified).is_ok_and(|age| age > std::time::Duration::from_secs(3600))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
    cubins.sort_by_key(|c| std::cmp::Reverse(c.0));
    for (_, path) in cubins.into_iter().skip(keep) {
        let _ = std::fs::remove_file(path);
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn run_nvrtc(family: &str, text: &str, arch: &str, opts: &[String]) -> Result<(Vec<u8>, String), CudaError> {
    let err = |e: rtc_sys::nvrtcResult| CudaError::Nvrtc(format!("{family}.cu: {e:?}"));
    let src = CString::new(text).map_err(|_| CudaError::Nvrtc(format!("{family}.cu holds a NUL byte")))?;
    let name = CString::new(format!("{family}.cu")).map_err(|_| CudaError::Nvrtc("bad name".into()))?;
    let prog = rtc::create_program(&src, Some(&name)).map_err(|e| err(e.0))?;
    // SAFETY: `prog` was just created and is destroyed below, once; `src` and `name` outlive it.
    let result = unsafe {
        let compiled = rtc::compile_program(prog, opts);
        let log = rtc::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        match compiled {
            Err(_) => Err(CudaError::Compile { family: family.into(), arch: arch.into(), log: log.trim().to_string() }),
            Ok(()) => {
                let mut size = 0usize;
                rtc_sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| err(e.0))?;
                let mut cubin = vec![0u8; size];
                rtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _).result().map_err(|e| err(e.0))?;
                Ok((cubin, log))
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { rtc::destroy_program(prog) };
    result
}

/// What ptxas reported for one kernel (`--ptxas-options=-v`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelReport {
    pub name: String,
    pub registers: u32,
    pub stack: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// The per-kernel lines of a verbose compile's log.
pub fn kernel_reports(log: &str) -> Vec<KernelReport> {
    let mut out: Vec<KernelReport> = Vec::new();
    let num = |s: &str, after: &str| -> Option<u32> {
        let i = s.find(after)? + after.len();
        s[i..].trim_start().split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelReport { name, ..Default::default() });
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes stack frame") {
                let nums: Vec<u32> = line
                    .split(|c: char| !c.is_ascii_digit())
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| s.parse().ok())
                    .collect();
                if let [stack, stores, loads, ..] = nums[..] {
                    (k.stack, k.spill_stores, k.spill_loads) = (stack, stores, loads);
                }
            } else if let Some(r) = num(line, "Used ") {
                k.registers = r;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_cache_keeps_the_newest_cubins_of_each_family() {
        let dir = std::env::temp_dir().join(format!("mpc-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let at = |secs: u64| std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        let touch_at = |name: &str, t: std::time::SystemTime| {
            let f = std::fs::File::create(dir.join(name)).unwrap();
            f.set_modified(t).unwrap();
        };
        let touch = |name: &str, secs: u64| touch_at(name, at(secs));
        for i in 0..6u64 {
            touch(&format!("norm-sm_90-{i:016x}.cubin"), 1_000_000 + i);
        }
        touch("norm-sm_80-0000000000000000.cubin", 10);
        touch("loss-sm_90-0000000000000000.cubin", 10);
        touch("loss-sm_90-0000000000000001.cubin.tmp77", 10);
        // A writer still at work: its temporary file stays.
        touch_at("loss-sm_90-0000000000000002.cubin.tmp78", std::time::SystemTime::now());
        prune(&dir, "norm-sm_90-", 4);
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            left,
            [
                "loss-sm_90-0000000000000000.cubin",
                "loss-sm_90-0000000000000002.cubin.tmp78",
                "norm-sm_80-0000000000000000.cubin",
                "norm-sm_90-0000000000000002.cubin",
                "norm-sm_90-0000000000000003.cubin",
                "norm-sm_90-0000000000000004.cubin",
                "norm-sm_90-0000000000000005.cubin",
            ]
        );
    }

    #[test]
    fn ptxas_reports_parse() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'train_adam_f32' for 'sm_90'\n\
ptxas info    : Function properties for train_adam_f32\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 400 bytes cmem[0]\n";
        let r = kernel_reports(log);
        assert_eq!(
            r,
            vec![KernelReport {
                name: "train_adam_f32".into(),
                registers: 40,
                stack: 8,
                spill_stores: 4,
                spill_loads: 12
            }]
        );
    }

    #[test]
    fn keys_are_stable() {
        assert_eq!(fnv(&[b"a", b"b"]), fnv(&[b"a", b"b"]));
        assert_ne!(fnv(&[b"ab", b""]), fnv(&[b"a", b"b"]));
    }
}
