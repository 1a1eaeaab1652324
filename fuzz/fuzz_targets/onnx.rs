//! ONNX bytes → the reader → compile (fp32, mixed) → write and read back → lower → CPU run.
#![no_main]

use libfuzzer_sys::{fuzz_mutator, fuzz_target};

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = mpc_ir::onnx::decode_onnx(data.to_vec().into(), None) {
        mpc_fuzz::exercise(g, data.last().is_some_and(|b| b & 1 == 1));
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    // Half the time a structural mutation of the decoded model, else libFuzzer's byte-level ones.
    if seed.is_multiple_of(2) {
        if let Some(out) = mpc_fuzz::mutate_onnx(&data[..size], seed) {
            if out.len() <= max_size {
                data[..out.len()].copy_from_slice(&out);
                return out.len();
            }
        }
    }
    libfuzzer_sys::fuzzer_mutate(data, size, max_size)
});
