//! Text IR → the parser → compile (fp32, mixed) → write and read back → lower → CPU run.
#![no_main]

use libfuzzer_sys::{fuzz_mutator, fuzz_target};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(g) = mpc_ir::text::parse(text, None) {
            mpc_fuzz::exercise(g, data.last().is_some_and(|b| b & 1 == 1));
        }
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    // Half the time lines and tokens of the text, else libFuzzer's byte-level mutations.
    if seed.is_multiple_of(2) {
        if let Ok(text) = std::str::from_utf8(&data[..size]) {
            let out = mpc_fuzz::mutate_text(text, seed);
            if out.len() <= max_size {
                data[..out.len()].copy_from_slice(out.as_bytes());
                return out.len();
            }
        }
    }
    libfuzzer_sys::fuzzer_mutate(data, size, max_size)
});
