//! Writes a synthetic model for the benchmarks.
//!
//!     cargo run --release --example synth -- resnet18 resnet18.onnx
//!     cargo run --release --example synth -- chain 100000 chain100k.onnx
//!     cargo run --release --example synth -- fanout 100000 fanout100k.onnx

use std::path::Path;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (g, out) = match args.as_slice() {
        [kind, out] if kind == "resnet18" => (mpc::synthetic::resnet18(), out),
        [kind, n, out] if kind == "chain" || kind == "fanout" => {
            let n: usize = n.parse().expect("node count");
            (if kind == "chain" { mpc::synthetic::chain(n) } else { mpc::synthetic::fan_out(n) }, out)
        }
        _ => {
            eprintln!("usage: synth resnet18 OUT.onnx | synth chain N OUT.onnx | synth fanout N OUT.onnx");
            std::process::exit(2);
        }
    };
    if let Err(e) = mpc::save(&g, Path::new(out), mpc::Format::Onnx) {
        eprintln!("synth: {e}");
        std::process::exit(2);
    }
}
