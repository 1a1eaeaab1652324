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

/// The lines to print, and the reason no GPU can be used, if none can.
#[cfg(feature = "cuda")]
pub fn report(options: &mpc_runtime::device::DeviceOptions) -> (Vec<String>, Option<String>) {
    let r = mpc_runtime::cuda::probe();
    let mut lines = vec![cpu_line()];
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
    let lines = vec![cpu_line(), "cuda: driver not looked for (this build has no CUDA support)".to_string()];
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
