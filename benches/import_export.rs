//! Import + export of a ResNet-18-sized model (46.8 MB of weights), whole `mpc` process.
//!
//!     cargo bench --bench import_export
//!
//! Generates the model (not committed), then runs `mpc compile resnet18.onnx --policy fp32
//! -o out.onnx --stats` several times and reports the median wall time of the whole process and its
//! peak resident memory as a multiple of the file size. Targets: under 0.5 s, under 3x.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

fn main() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let model = dir.join("resnet18.onnx");
    let out = dir.join("resnet18.out.onnx");
    let g = mpc::synthetic::resnet18();
    mpc::save(&g, &model, mpc::Format::Onnx).expect("write the model");
    let size = std::fs::metadata(&model).expect("model size").len();
    let runs = 7;
    let mut times = Vec::new();
    let mut peaks = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let r = Command::new(env!("CARGO_BIN_EXE_mpc"))
            .args(["compile", model.to_str().unwrap(), "--policy", "fp32", "-o", out.to_str().unwrap(), "--stats"])
            .output()
            .expect("run mpc");
        times.push(t.elapsed().as_secs_f64());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let stats = String::from_utf8_lossy(&r.stderr).to_string();
        let peak: f64 = stats
            .rsplit("peak memory ")
            .next()
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .expect("peak memory in --stats");
        peaks.push(peak * (1u64 << 20) as f64);
    }
    times.sort_by(f64::total_cmp);
    peaks.sort_by(f64::total_cmp);
    let (t, peak) = (times[runs / 2], peaks[runs / 2]);
    let out_size = std::fs::metadata(&out).expect("output").len();
    println!("resnet18.onnx: {:.1} MB, {} nodes", size as f64 / 1e6, g.node_count());
    println!("output:        {:.1} MB", out_size as f64 / 1e6);
    println!(
        "import + export (whole process, median of {runs}): {:.3} s  [target < 0.5 s: {}]",
        t,
        if t < 0.5 { "met" } else { "NOT met" }
    );
    println!(
        "peak memory: {:.1} MB = {:.2}x the file  [target < 3x: {}]",
        peak / 1e6,
        peak / size as f64,
        if peak < 3.0 * size as f64 { "met" } else { "NOT met" }
    );
}
