//! The training contract of a graph: which outputs are the loss and the step-skipped flag, which
//! initializer is the loss scale, and which output is each state value's next value.
//!
//! The training passes record it as they build the step and hand it to each other through the
//! graph ([`Graph::train`]); a runtime reads it to keep the state resident and to find the loss.
//! It is data of the graph, not of any file format: the ONNX writer and the text IR printer store
//! the part a runtime needs ([`TrainSignature::to_metadata`]) as `mpc.train.*` metadata only when
//! they write, and the readers turn those entries back into a signature
//! ([`TrainSignature::take_from_metadata`]), so an exported training step still trains. What the
//! passes pass between themselves (the scaled loss, the gradients) is never written.

use crate::{Graph, IrError, ValueId};

/// Metadata key listing the state pairs, one `state -> next` per line.
pub const STATE_KEY: &str = "mpc.train.state";
/// Metadata key naming the loss output.
pub const LOSS_KEY: &str = "mpc.train.loss";
/// Metadata key naming the step-skipped flag.
pub const SKIPPED_KEY: &str = "mpc.train.skipped";
/// Metadata key naming the loss-scale state.
pub const SCALE_KEY: &str = "mpc.train.loss_scale";
/// Metadata key naming the learning rate a scheduled step applied.
pub const LR_KEY: &str = "mpc.train.lr";

/// What a training graph promises its runtime, by value id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainSignature {
    /// The FP32 loss (unscaled).
    pub loss: Option<ValueId>,
    /// The loss times the loss scale, which the backward pass starts from (between passes only).
    pub scaled_loss: Option<ValueId>,
    /// True when the step found a non-finite gradient and changed nothing.
    pub skipped: Option<ValueId>,
    /// The loss-scale state (an initializer), when the step scales its loss.
    pub loss_scale: Option<ValueId>,
    /// The learning rate the step applied, when a schedule computes it from the step count (the
    /// rate is otherwise the state `mpc.lr` itself).
    pub lr: Option<ValueId>,
    /// Each state initializer and the output holding its value after the step.
    pub state: Vec<(ValueId, ValueId)>,
    /// Each parameter and its gradient (between passes only).
    pub grads: Vec<(ValueId, ValueId)>,
    /// Each forward activation on a parameter's path and its gradient (between passes only: what
    /// range measurement histograms).
    pub activation_grads: Vec<(ValueId, ValueId)>,
    /// Each state value that holds this rank's block of a tensor of the given shape, flattened
    /// and padded (a sharded optimizer state: masters, moments and low copies). Not written to
    /// files: a runtime that reads a sharded step from one cannot gather its state.
    pub sharded: Vec<(ValueId, Vec<u64>)>,
}

impl TrainSignature {
    /// Redirects every mention of `old` to `new` (a rewrite replaced the value).
    pub fn replace(&mut self, old: ValueId, new: ValueId) {
        let swap = |v: &mut ValueId| {
            if *v == old {
                *v = new;
            }
        };
        for v in [&mut self.loss, &mut self.scaled_loss, &mut self.skipped, &mut self.loss_scale, &mut self.lr]
            .into_iter()
            .flatten()
        {
            swap(v);
        }
        for (a, b) in self.state.iter_mut().chain(self.grads.iter_mut()).chain(self.activation_grads.iter_mut()) {
            swap(a);
            swap(b);
        }
        for (a, _) in &mut self.sharded {
            swap(a);
        }
    }

    /// The entries a file stores: loss, skipped flag, loss scale and state pairs, by name.
    pub fn to_metadata(&self, g: &Graph) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (key, v) in
            [(LOSS_KEY, self.loss), (SKIPPED_KEY, self.skipped), (SCALE_KEY, self.loss_scale), (LR_KEY, self.lr)]
        {
            if let Some(v) = v {
                out.push((key.to_string(), g.name(v).to_string()));
            }
        }
        if !self.state.is_empty() {
            let lines: Vec<String> =
                self.state.iter().map(|&(s, n)| format!("{} -> {}", g.name(s), g.name(n))).collect();
            out.push((STATE_KEY.to_string(), lines.join("\n")));
        }
        out
    }

    /// Reads (and removes) the `mpc.train.*` entries of `g`'s metadata; `None` when there are
    /// none. A name the graph does not define is an error naming the key and the name.
    pub fn take_from_metadata(g: &mut Graph) -> Result<Option<TrainSignature>, IrError> {
        let is_ours = |k: &str| [STATE_KEY, LOSS_KEY, SKIPPED_KEY, SCALE_KEY, LR_KEY].contains(&k);
        if !g.meta.metadata_props.iter().any(|(k, _)| is_ours(k)) {
            return Ok(None);
        }
        let (ours, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut g.meta.metadata_props).into_iter().partition(|(k, _)| is_ours(k));
        g.meta.metadata_props = rest;
        let find = |key: &str, name: &str| {
            g.find(name).ok_or_else(|| {
                IrError::Invalid(format!("metadata `{key}` names `{name}`, which the graph does not define"))
            })
        };
        let mut sig = TrainSignature::default();
        for (key, value) in &ours {
            match key.as_str() {
                LOSS_KEY => sig.loss = Some(find(key, value)?),
                SKIPPED_KEY => sig.skipped = Some(find(key, value)?),
                SCALE_KEY => sig.loss_scale = Some(find(key, value)?),
                LR_KEY => sig.lr = Some(find(key, value)?),
                _ => {
                    for line in value.lines().filter(|l| !l.trim().is_empty()) {
                        let (s, n) = line.split_once(" -> ").ok_or_else(|| {
                            IrError::Invalid(format!("metadata `{key}`: `{line}` is not `state -> next`"))
                        })?;
                        sig.state.push((find(key, s)?, find(key, n)?));
                    }
                }
            }
        }
        Ok(Some(sig))
    }
}
