//! Every kernel family of `kernels/` compiles with NVRTC to cubins for sm_80 and sm_90, with no
//! GPU: a kernel that does not compile, or that spills registers, fails here. NVRTC comes from
//! the system or the nvidia-cuda-nvrtc wheel (`.ci/run` installs it and sets
//! `MPC_REQUIRE_NVRTC=1`, so that a missing NVRTC fails there instead of skipping).

#![cfg(feature = "cuda")]

use mpc_runtime::cuda::nvrtc;

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_spills() {
    let required = std::env::var_os("MPC_REQUIRE_NVRTC").is_some();
    let ready = nvrtc::version().and_then(|v| nvrtc::include_dir().map(|i| (v, i)));
    let (version, include) = match ready {
        Ok(r) => r,
        Err(e) if !required => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    println!("kernels: NVRTC {}.{}, headers from {}", version.0, version.1, include.display());
    // Each (architecture, family) compiles on its own thread, as many at once as there are cores
    // (NVRTC may be called from several threads at once); the reports print in order.
    let jobs: Vec<(&str, &str, &str)> =
        ["sm_80", "sm_90"].iter().flat_map(|&a| nvrtc::FAMILIES.iter().map(move |&(f, s)| (a, f, s))).collect();
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut lines: Vec<(usize, String, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(arch, family, source)) = jobs.get(i) else { return done };
                        let (line, n) = check(family, source, arch);
                        done.push((i, line, n));
                    }
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    lines.sort_by_key(|l| l.0);
    let mut total = 0;
    for (_, line, n) in lines {
        println!("{line}");
        total += n;
    }
    println!("kernels: {total} compilations, 0 failures");
    // A second compile of the same source, architecture and options is a cache hit.
    let (family, source) = nvrtc::FAMILIES[3];
    nvrtc::compile(family, source, "sm_90", false).unwrap();
    assert!(nvrtc::compile(family, source, "sm_90", false).unwrap().cached, "the second compile was not cached");
}

/// Compiles one family for one architecture with ptxas's report: its line of the report and its
/// number of kernels. Panics on a failed compile, a warning or a spill.
fn check(family: &str, source: &str, arch: &str) -> (String, usize) {
    let c = nvrtc::compile(family, source, arch, true).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.cubin.starts_with(b"\x7fELF"), "{family} {arch}: not a cubin");
    let reports = nvrtc::kernel_reports(&c.log);
    assert!(!reports.is_empty(), "{family} {arch}: no kernels in the ptxas report:\n{}", c.log);
    let warnings: Vec<&str> = c.log.lines().filter(|l| l.contains("warning")).collect();
    assert!(warnings.is_empty(), "{family} {arch}: {warnings:?}");
    for k in &reports {
        assert!(
            k.spill_stores == 0 && k.spill_loads == 0,
            "{family} {arch}: {} spills ({} bytes stored, {} loaded)",
            k.name,
            k.spill_stores,
            k.spill_loads
        );
    }
    let worst = reports.iter().max_by_key(|k| k.registers).expect("kernels");
    let line = format!(
        "kernels: {family}.cu {arch}: {} kernels, no spills, at most {} registers ({})",
        reports.len(),
        worst.registers,
        worst.name
    );
    (line, reports.len())
}

#[test]
fn a_compile_error_carries_the_nvrtc_log() {
    if nvrtc::version().and_then(|_| nvrtc::include_dir()).is_err() {
        eprintln!("skipped: no NVRTC");
        return;
    }
    let e = nvrtc::compile("broken", "extern \"C\" __global__ void k() { undeclared(); }", "sm_80", false).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("broken.cu") && msg.contains("undeclared"), "{msg}");
}
