//! Tied weights: parameters that an exporter wrote twice.
//!
//! A language model whose output head shares the token embedding (GPT-2's `lm_head` is `wte`)
//! is one parameter in the framework, but the legacy torch exporter writes the head as a second
//! initializer holding `wteᵀ`. Trained as two, the copies get half the gradient each and drift
//! apart. [`tie_weights`] finds float initializers that are exact copies or transposes of an
//! earlier one and makes their readers read the earlier one (through a Transpose), so the
//! gradient of both uses reaches one parameter.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use mpc_ir::ops::TransposeAttrs;
use mpc_ir::{Graph, Op, Tensor, ValueId};

/// One tie: `copy` now reads `kept` (transposed when `transposed`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tie {
    pub copy: String,
    pub kept: String,
    pub transposed: bool,
}

/// Ties every candidate (in `candidates`, the would-be parameters) that equals an earlier one or
/// its transpose. Tensors whose elements are all equal (fresh biases, norm scales) are never
/// tied: they are equal by initialisation, not by sharing.
pub fn tie_weights(g: &mut Graph, candidates: &[ValueId]) -> Vec<Tie> {
    // Earlier candidates by a hash of their tensor; equality is checked in full.
    let mut seen: HashMap<u64, Vec<ValueId>> = HashMap::new();
    let mut ties = Vec::new();
    for &v in candidates {
        let Some(t) = g.value(v).initializer().cloned() else { continue };
        let first = t.values().next();
        if t.numel() < 2 || t.values().all(|x| Some(x) == first) {
            continue;
        }
        let find = |t: &Tensor| {
            seen.get(&hash(t)).into_iter().flatten().copied().find(|&k| g.value(k).initializer() == Some(t))
        };
        let (kept, transposed) = match find(&t) {
            Some(k) => (k, false),
            None => match transpose(&t).and_then(|tt| find(&tt)) {
                Some(k) => (k, true),
                None => {
                    seen.entry(hash(&t)).or_default().push(v);
                    continue;
                }
            },
        };
        ties.push(Tie { copy: g.name(v).to_string(), kept: g.name(kept).to_string(), transposed });
        tie(g, v, kept, transposed);
    }
    ties
}

/// Makes the same ties in another graph holding the same initializers (the model that trained
/// weights are written into): ties whose names it lacks are skipped.
pub fn apply_ties(g: &mut Graph, ties: &[Tie]) {
    for t in ties {
        if let (Some(v), Some(kept)) = (g.find(&t.copy), g.find(&t.kept)) {
            if g.value(v).initializer().is_some() {
                tie(g, v, kept, t.transposed);
            }
        }
    }
}

/// Makes the readers of `copy` read `kept` (through a Transpose when `transposed`) and drops it.
fn tie(g: &mut Graph, copy: ValueId, kept: ValueId, transposed: bool) {
    let read = if transposed {
        let name = g.unique_name(&format!("{}.tied", g.name(copy)));
        let op = Op::Transpose(TransposeAttrs { perm: Some(vec![1, 0]) });
        let (_, outs) = g.add_op(&name, op, &[Some(kept)], 1);
        g.set_ty(outs[0], g.ty(copy).clone());
        outs[0]
    } else {
        kept
    };
    g.replace_uses(copy, read);
    g.remove_value(copy);
}

fn hash(t: &Tensor) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    t.hash(&mut h);
    h.finish()
}

/// The transpose of a matrix (`None` for other ranks).
fn transpose(t: &Tensor) -> Option<Tensor> {
    let &[r, c] = t.shape() else { return None };
    let (r, c) = (usize::try_from(r).ok()?, usize::try_from(c).ok()?);
    let size = t.dtype().size();
    let src = t.bytes();
    let mut out = vec![0u8; src.len()];
    for i in 0..r {
        for j in 0..c {
            let (from, to) = ((i * c + j) * size, (j * r + i) * size);
            out[to..to + size].copy_from_slice(&src[from..from + size]);
        }
    }
    Tensor::from_bytes(t.dtype(), vec![c as u64, r as u64], out.into()).ok()
}
