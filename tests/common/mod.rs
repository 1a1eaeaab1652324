//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const FIXTURES: [&str; 8] =
    ["mlp", "mlp_loss", "cnn_bn", "resblock", "transformer", "opset9", "custom_op", "control_flow"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models").join(format!("{name}.onnx"))
}

/// A fresh scratch folder for one test.
pub fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

pub fn mpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mpc")).args(args).output().expect("run mpc")
}

pub fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("snapshots"));
    s.set_prepend_module_to_snapshot(false);
    s.set_omit_expression(true);
    s
}

/// Instantiates each `name => generic test function` once per device, the function receiving a
/// factory of fresh devices. The CUDA device adds its line here, and every test written this way
/// holds it to the CPU's results.
#[allow(unused_macros)]
macro_rules! per_device {
    ($($name:ident => $f:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() {
                    super::$f(mpc_runtime::device::CpuDevice::default)
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use per_device;
