//! `mpc devices`: what mpc can run on here: the CPU, and each GPU with the CUDA driver and
//! libraries it finds, or why it finds none.

/// The threads the CPU device's matrix products use (matrixmultiply: `MATMUL_NUM_THREADS`, else
/// the physical cores, at most 4) and the machine's logical cores.
fn cpu_line() -> String {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let gemm = std::env::var("MATMUL_NUM_THREADS").ok().and_then(|v| v.parse::<usize>().ok());
    let gemm = gemm.map_or_else(|| format!("up to {}", logical.min(4)), |n| n.to_string());
    format!("cpu: {logical} logical cores (matrix products on {gemm} threads); the reference device, always present")
}

/// Whether this mpc can run data-parallel (`--distributed`): the MPI library it was built with.
fn mpi_line() -> String {
    #[cfg(feature = "mpi")]
    {
        let v = mpi::environment::library_version().unwrap_or_default();
        let first = v.lines().next().unwrap_or("an MPI library").trim().to_string();
        format!("mpi: {first}; `mpiexec -n N mpc train --distributed` trains data-parallel on the CPU")
    }
    #[cfg(not(feature = "mpi"))]
    {
        "mpi: not built in (`cargo build --release --features mpi` for `mpc train --distributed`)".to_string()
    }
}

/// NCCL where the system's loader finds it, with its version: what a CUDA device's collectives
/// will use (none are built yet).
fn nccl_line() -> String {
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: loading NCCL runs its initialisers, which only register the library;
        // `ncclGetVersion` writes one int.
        let Ok(lib) = (unsafe { libloading::Library::new(name) }) else { continue };
        type GetVersion = unsafe extern "C" fn(*mut i32) -> i32;
        let mut code = 0i32;
        let got = unsafe { lib.get::<GetVersion>(b"ncclGetVersion\0") }.map(|f| unsafe { f(&mut code) });
        let version = match got {
            Ok(0) if code >= 10000 => format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100),
            Ok(0) => format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100),
            _ => "of unknown version".to_string(),
        };
        return format!(
            "nccl: {name} {version} (the CUDA device has no collectives yet: a distributed run is on the CPU)"
        );
    }
    "nccl: not found (the CUDA device has no collectives yet: a distributed run is on the CPU)".to_string()
}

/// The lines to print, and the reason no GPU can be used, if none can.
#[cfg(feature = "cuda")]
pub fn report(options: &mpc_runtime::device::DeviceOptions) -> (Vec<String>, Option<String>) {
    let r = mpc_runtime::cuda::probe();
    let mut lines = vec![cpu_line(), mpi_line(), nccl_line()];
    let v = |x: Option<(i32, i32)>| x.map_or("not found".to_string(), |(a, b)| format!("{a}.{b}"));
    let found = |b: bool| if b { "found" } else { "not found" };
    let cudnn = mpc_runtime::cuda::dnn::unavailable(options)
        .map_or("found".to_string(), |why| format!("not used ({why}; convolutions run as im2col and GEMMs)"));
    let lt = mpc_runtime::cuda::lt::unavailable(options).map_or("found".to_string(), |why| {
        format!("not used ({why}; products run a separate bias broadcast and ReLU)")
    });
    lines.push(format!(
        "cuda: driver {} (mpc needs CUDA {}.{}), NVRTC {}, cuBLAS {}, cuBLASLt {lt}, cuDNN {cudnn}",
        v(r.driver),
        mpc_runtime::cuda::CUDA_VERSION.0,
        mpc_runtime::cuda::CUDA_VERSION.1,
        v(r.nvrtc),
        found(r.cublas),
    ));
    for g in &r.gpus {
        lines.push(format!(
            "gpu {}: {}, compute capability {}.{} ({}), {:.1} GiB",
            g.ordinal,
            g.name,
            g.compute_capability.0,
            g.compute_capability.1,
            g.arch(),
            g.memory_bytes as f64 / (1u64 << 30) as f64
        ));
    }
    (lines, r.problem.map(|p| format!("no GPU to use: {p}")))
}

#[cfg(not(feature = "cuda"))]
pub fn report(_options: &mpc_runtime::device::DeviceOptions) -> (Vec<String>, Option<String>) {
    let cuda = "cuda: driver not looked for (this build has no CUDA support)".to_string();
    let lines = vec![cpu_line(), mpi_line(), nccl_line(), cuda];
    (lines, Some("no GPU to use: this build has no CUDA support (the `cuda` feature is off)".into()))
}

/// Why `--device cuda` cannot run a program here, in one line.
pub fn cuda_refusal() -> String {
    #[cfg(feature = "cuda")]
    {
        match mpc_runtime::cuda::gpus() {
            Err(e) => e.to_string(),
            Ok((g, _)) => format!("{} GPU(s) found ({})", g.len(), g[0].name),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        "this build has no CUDA support (the `cuda` feature is off); use --device cpu".into()
    }
}
