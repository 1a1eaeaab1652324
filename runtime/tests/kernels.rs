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
    let mut total = 0;
    for arch in ["sm_80", "sm_90"] {
        for (family, source) in nvrtc::FAMILIES {
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
            println!(
                "kernels: {family}.cu {arch}: {} kernels, no spills, at most {} registers ({})",
                reports.len(),
                worst.registers,
                worst.name
            );
            total += reports.len();
        }
    }
    println!("kernels: {total} compilations, 0 failures");
    // A second compile of the same source, architecture and options is a cache hit.
    let (family, source) = nvrtc::FAMILIES[3];
    nvrtc::compile(family, source, "sm_90", false).unwrap();
    assert!(nvrtc::compile(family, source, "sm_90", false).unwrap().cached, "the second compile was not cached");
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
