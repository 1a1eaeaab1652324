//! The checkpoint format: every state value under its graph name and `mpc.iteration`, the count
//! of batches done; and the checks a state read back must pass.

use std::collections::HashMap;

use mpc_ir::DType;
use mpc_runtime::HostTensor;

/// The name of the count of batches a checkpoint has done.
pub const ITERATION: &str = "mpc.iteration";
/// The name of the samples per update (over all ranks) of the run that wrote a checkpoint.
pub const GLOBAL_BATCH: &str = "mpc.global_batch";

/// How far a checkpointed run got: its batches done, and (where the run said) the samples in
/// each, over all ranks: what the batches done count in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub iteration: usize,
    pub global_batch: Option<usize>,
}

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

/// How far `saved` got (its `mpc.iteration` and `mpc.global_batch`), or what is wrong with it.
pub(super) fn progress(saved: &HashMap<String, HostTensor>) -> std::result::Result<Progress, String> {
    let count = |name: &str, of: &str| match saved.get(name).map(|t| (t.shape.as_slice(), t.i64s())) {
        None => Ok(None),
        Some(([], Some(v))) if v.first().is_some_and(|&n| n >= 0) => Ok(Some(v[0] as usize)),
        Some(_) => Err(format!("`{name}` is not a count of {of} (a non-negative int64 scalar)")),
    };
    let iteration =
        count(ITERATION, "batches")?.ok_or_else(|| format!("no `{ITERATION}`: not a checkpoint mpc wrote"))?;
    Ok(Progress { iteration, global_batch: count(GLOBAL_BATCH, "samples")? })
}

/// The scalars that say how far a run got, as a checkpoint stores them.
pub(super) fn progress_tensors(p: Progress) -> Vec<(String, HostTensor)> {
    let count = |n: usize| HostTensor::from_i64(DType::I64, vec![], vec![n as i64]);
    let mut out = vec![(ITERATION.to_string(), count(p.iteration))];
    out.extend(p.global_batch.map(|g| (GLOBAL_BATCH.to_string(), count(g))));
    out
}
