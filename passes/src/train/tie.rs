//! Tied weights: parameters that an exporter wrote twice.
//!
//! A language model whose output head shares the token embedding (GPT-2's `lm_head` is `wte`)
//! is one parameter in the framework, but the legacy torch exporter writes the head as a second
//! initializer holding `wteᵀ`. Trained as two, the copies get half the gradient each and drift
//! apart. [`tie_weights`] finds float initializers that are exact copies or transposes of an
//! earlier one and makes their readers read the earlier one (through a Transpose), so the
//! gradient of both uses reaches one parameter.

use std::collections::HashMap;

use mpc_ir::ops::TransposeAttrs;
use mpc_ir::{DType, Graph, Op, Tensor, ValueId};

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
    // Earlier candidates by their fingerprint; equality is checked in full.
    let mut seen: HashMap<Fingerprint, Vec<ValueId>> = HashMap::new();
    let mut ties = Vec::new();
    let signature = super::ExportSignature::of(g);
    for &v in candidates {
        let Some(t) = g.value(v).initializer().cloned() else { continue };
        if t.numel() < 2 || t.all_equal() {
            continue;
        }
        let find = |key: Option<&Fingerprint>, same: &dyn Fn(&Tensor) -> bool| {
            let earlier = key.and_then(|k| seen.get(k));
            earlier
                .into_iter()
                .flatten()
                .copied()
                .find(|&k| g.value(k).initializer().is_some_and(same) && one_parameter(g, signature.as_ref(), k, v))
        };
        let own = fingerprint(&t, false).expect("a tensor's own fingerprint");
        let (kept, transposed) = match find(Some(&own), &|x| x == &t) {
            Some(k) => (k, false),
            None => match find(fingerprint(&t, true).as_ref(), &|x| is_transpose(x, &t)) {
                Some(k) => (k, true),
                None => {
                    seen.entry(own).or_default().push(v);
                    continue;
                }
            },
        };
        ties.push(Tie { copy: g.name(v).to_string(), kept: g.name(kept).to_string(), transposed });
        tie(g, v, kept, transposed);
    }
    ties
}

/// Whether equal initializers `a` and `b` are one parameter an exporter wrote twice: one is the
/// model's own parameter and the other a copy the exporter made of it (a tied head written
/// transposed), which it names itself (`onnx::MatMul_597`, `val_231`). Two parameters of the
/// model's own, or two constants the exporter folded from two parameters, are equal only by
/// initialisation (the deep-copied layers of torch's `nn.TransformerEncoder`) and train apart, as
/// in torch. The model's own: the parameters an export's torch.export signature names, or,
/// without one, the names no exporter made.
fn one_parameter(g: &Graph, signature: Option<&super::ExportSignature>, a: ValueId, b: ValueId) -> bool {
    let own = |v: ValueId| {
        let name = g.name(v);
        match signature {
            Some(s) => s.names_parameter(name),
            None => !exporter_named(name),
        }
    };
    own(a) != own(b)
}

/// A name a torch exporter gives a value it made (a folded constant), not a module's parameter.
fn exporter_named(name: &str) -> bool {
    let numbered = |rest: &str| !rest.is_empty() && rest.bytes().all(|c| c.is_ascii_digit());
    name.is_empty() || name.starts_with("onnx::") || name.strip_prefix("val_").is_some_and(numbered)
}

/// A tensor's dtype, shape and the bytes of 64 of its elements at fixed places of its row-major
/// order: equal tensors have equal fingerprints, read in a few cache lines, where a hash of every
/// byte read a model's whole weights (twice, with each matrix's transpose built to hash it).
type Fingerprint = (DType, Vec<u64>, Vec<u8>);

/// `t`'s fingerprint, or its transpose's when `transposed` (`None` for a tensor not a matrix).
fn fingerprint(t: &Tensor, transposed: bool) -> Option<Fingerprint> {
    let (size, bytes, n) = (t.dtype().size(), t.bytes(), t.numel() as usize);
    let (shape, at): (Vec<u64>, Box<dyn Fn(usize) -> usize>) = if transposed {
        let &[r, c] = t.shape() else { return None };
        let (r, c) = (r as usize, c as usize);
        // Element k of the transpose (c × r) is element (k mod r, k / r) of t.
        (vec![c as u64, r as u64], Box::new(move |k| (k % r) * c + k / r))
    } else {
        (t.shape().to_vec(), Box::new(|k| k))
    };
    let m = n.min(64);
    let mut sample = Vec::with_capacity(m * size);
    for i in 0..m {
        let k = if m > 1 { i * (n - 1) / (m - 1) } else { 0 };
        sample.extend_from_slice(&bytes[at(k) * size..][..size]);
    }
    Some((t.dtype(), shape, sample))
}

/// Whether `x` is the transpose of the matrix `t`, element for element.
fn is_transpose(x: &Tensor, t: &Tensor) -> bool {
    let &[r, c] = t.shape() else { return false };
    let (r, c) = (r as usize, c as usize);
    if x.dtype() != t.dtype() || x.shape() != [c as u64, r as u64] {
        return false;
    }
    let (size, a, b) = (t.dtype().size(), t.bytes(), x.bytes());
    (0..r).all(|i| (0..c).all(|j| a[(i * c + j) * size..][..size] == b[(j * r + i) * size..][..size]))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(r: u64, c: u64, f: impl Fn(u64, u64) -> f32) -> Tensor {
        let v: Vec<f32> = (0..r * c).map(|k| f(k / c, k % c)).collect();
        Tensor::from_f32(vec![r, c], &v)
    }

    /// A copy and a transpose are tied to the first; a matrix that differs from another in one
    /// element that no fingerprint reads, or from a transpose in one, is not; nor are tensors
    /// of one value (zeros of both signs included) or of NaNs.
    #[test]
    fn copies_and_transposes_are_tied_and_near_misses_and_constants_are_not() {
        let w = |i: u64, j: u64| (i * 37 + j * 11) as f32 * 0.25;
        let mut g = Graph::new("t");
        let odd = |r: u64, c: u64, at: (u64, u64)| matrix(r, c, move |i, j| if (i, j) == at { -1.0 } else { w(i, j) });
        let near = odd(30, 40, (17, 23));
        assert_eq!(fingerprint(&near, false), fingerprint(&matrix(30, 40, w), false), "a miss no sample sees");
        let names =
            ["w", "onnx::MatMul_7", "val_12", "near", "near_t", "zeros", "nans", "layers.1.w", "v", "onnx::v", "val_3"];
        let tensors = [
            matrix(30, 40, w),
            matrix(30, 40, w),
            matrix(40, 30, |i, j| w(j, i)),
            near,
            matrix(40, 30, |i, j| if (j, i) == (5, 7) { 9.0 } else { w(j, i) }),
            matrix(3, 4, |i, j| if (i + j) % 2 == 0 { 0.0 } else { -0.0 }),
            matrix(3, 4, |_, _| f32::NAN),
            // Another parameter of the model's own, equal by initialisation (a deep-copied layer).
            matrix(30, 40, w),
            // Two constants folded from two such parameters, and their own parameter.
            matrix(5, 6, |i, j| w(i, j) + 1.0),
            matrix(6, 5, |i, j| w(j, i) + 2.0),
            matrix(6, 5, |i, j| w(j, i) + 2.0),
        ];
        let ids: Vec<ValueId> = names.iter().zip(tensors).map(|(n, t)| g.add_initializer(n, t)).collect();
        let ties = tie_weights(&mut g, &ids);
        let got: Vec<(&str, &str, bool)> =
            ties.iter().map(|t| (t.copy.as_str(), t.kept.as_str(), t.transposed)).collect();
        assert_eq!(got, [("onnx::MatMul_7", "w", false), ("val_12", "w", true)]);
        assert!(matrix(3, 4, |i, j| if (i + j) % 2 == 0 { 0.0 } else { -0.0 }).all_equal());
        assert!(!matrix(3, 4, |_, _| f32::NAN).all_equal());
    }
}
