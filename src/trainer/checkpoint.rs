//! The checkpoint format: every state value under its graph name and `mpc.iteration`, the count
//! of batches done; and the checks a state read back must pass.

use std::collections::HashMap;

use mpc_ir::DType;
use mpc_runtime::HostTensor;

/// The name of the count of batches a checkpoint has done.
pub const ITERATION: &str = "mpc.iteration";

/// The state `mpc.<dtype>.<master>` (a master weight's low-precision copy) made from the master
/// in `saved`, when `name` is such a copy that `saved` does not hold.
pub(super) fn low_copy_of(name: &str, saved: &HashMap<String, HostTensor>, dtype: Option<DType>) -> Option<HostTensor> {
    let dtype = dtype.filter(|d| matches!(d, DType::F16 | DType::BF16))?;
    let master = name.strip_prefix(&format!("mpc.{dtype}."))?;
    (!saved.contains_key(name)).then(|| saved.get(master).map(|m| m.cast(dtype))).flatten()
}

/// Checks a state tensor read from a checkpoint: finite floats; integer counters not negative
/// (the random key `mpc.rng` may be anything); the loss scale within its bounds.
pub(super) fn check_state(
    name: &str,
    t: &HostTensor,
    scale_bounds: Option<(f32, f32)>,
) -> std::result::Result<(), String> {
    if t.dtype().is_float() {
        if let Some(x) = t.f64s().into_iter().find(|x| !x.is_finite()) {
            return Err(format!("`{name}` holds {x}: a checkpoint holds only finite values"));
        }
        if let (Some((lo, hi)), Some(&s)) = (scale_bounds, t.f64s().first()) {
            if s < f64::from(lo) || s > f64::from(hi) {
                return Err(format!(
                    "the loss scale `{name}` is {s}, outside the dynamic scaling's bounds [{lo}, {hi}]"
                ));
            }
        }
    } else if name != mpc_passes::train::RNG {
        if let Some(x) = t.i64s().unwrap_or_default().into_iter().find(|&x| x < 0) {
            return Err(format!("the counter `{name}` is {x}: counters are never negative"));
        }
    }
    Ok(())
}

/// The count of batches `saved` has done (its `mpc.iteration`), or what is wrong with it.
pub(super) fn iteration(saved: &HashMap<String, HostTensor>) -> std::result::Result<usize, String> {
    let done = saved.get(ITERATION).ok_or_else(|| format!("no `{ITERATION}`: not a checkpoint mpc wrote"))?;
    match (done.shape.as_slice(), done.i64s().as_deref()) {
        ([], Some(&[n])) if n >= 0 => Ok(n as usize),
        _ => Err(format!("`{ITERATION}` is not a count of batches (a non-negative int64 scalar)")),
    }
}
