//! The gradient rules of data movement and indexing ([`super::rule`] dispatches by family).

use super::*;

/// The views and data movement ([`Kind::View`], [`Kind::Movement`]).
pub(super) fn movement(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { node, y, dy, dys, .. } = *at;
    let x = |i: usize| at.x(i);
    Ok(match op {
        // d/dx x = 1 (Dropout in inference mode is the identity).
        Op::Identity => vec![Some(dy)],
        // dX = Tᵀ·dY along each resized axis, T its taps (a nearest upscale's blocks summed back).
        Op::Resize(a) => vec![Some(rules::resize(b, node, a, dy)?)],
        // Shape-only ops: the gradient takes the input's shape back.
        Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze | Op::Unsqueeze => {
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, s]))]
        }
        // d transpose(x, p) = transpose(dy, p⁻¹).
        Op::Transpose(a) => {
            let r = b.shape(x(0)?)?.rank();
            let perm: Vec<usize> = match &a.perm {
                Some(p) => p.iter().map(|&d| normalize_axis(d, r).ok_or("bad perm")).collect::<Result<_, _>>()?,
                None => (0..r).rev().collect(),
            };
            let mut inv = vec![0i64; r];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i as i64;
            }
            vec![Some(b.op("transpose", Op::Transpose(TransposeAttrs { perm: Some(inv) }), &[dy]))]
        }
        // d concat = split of dy at the inputs' sizes.
        Op::Concat(a) => {
            let r = b.shape(y)?.rank();
            let ax = normalize_axis(a.axis, r).ok_or("bad axis")?;
            let parts: Vec<ValueId> = node.inputs().iter().flatten().copied().collect();
            let fixed_sizes: Option<Vec<i64>> = parts
                .iter()
                .map(|&v| Ok(b.shape(v)?.dims()[ax].fixed().map(|d| d as i64)))
                .collect::<Result<Vec<_>, String>>()?
                .into_iter()
                .collect();
            let s = match fixed_sizes {
                Some(sizes) => b.ints(&sizes),
                // Symbolic lengths (a sequence): split by the inputs' own sizes, from their shapes.
                None => {
                    let at = b.ints(&[ax as i64]);
                    let each: Vec<Option<ValueId>> = parts
                        .iter()
                        .map(|&v| {
                            let shape = b.shape_of(v);
                            Some(b.op("len", Op::Gather(AxisAttrs { axis: 0 }), &[shape, at]))
                        })
                        .collect();
                    b.ops("sizes", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &each, 1)[0]
                }
            };
            let split = Op::Split(SplitAttrs { axis: ax as i64, num_outputs: None });
            b.ops("split", split, &[Some(dy), Some(s)], parts.len()).into_iter().map(Some).collect()
        }
        // d split = concat of the outputs' gradients (zeros for outputs nothing reads).
        Op::Split(a) => {
            let mut parts = Vec::new();
            for (i, &o) in node.outputs().iter().enumerate() {
                parts.push(Some(match dys.get(i).copied().flatten() {
                    Some(d) => d,
                    None => b.zeros_like(o)?,
                }));
            }
            vec![Some(b.ops("concat", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: a.axis }), &parts, 1)[0])]
        }
        // d slice = dy padded back to the input's extent (unit steps).
        // d slice = dy padded back to x's shape with zeros (steps of 1); see `rules::slice`.
        Op::Slice => vec![Some(rules::slice(b, node, dy)?)],
        // d trilu(x, k) = trilu(dy, k): the kept triangle passes dy, the rest nothing.
        Op::Trilu(a) => {
            let mut ins = vec![Some(dy)];
            ins.extend(node.input(1).map(Some));
            vec![Some(b.ops("trilu", Op::Trilu(a.clone()), &ins, 1)[0])]
        }
        // d expand = dy summed over the expanded axes.
        Op::Expand => vec![Some(b.unbroadcast(dy, x(0)?, y)?)],
        // d tile(x) = the sum of dy's copies.
        Op::Tile => vec![Some(rules::tile(b, node, dy)?)],
        // d pad(x, p) = pad(dy, −p): what was added is cropped, what was cut comes back as zeros.
        Op::Pad(a) => vec![Some(rules::pad(b, node, a, dy)?)],
        other => return Err(no_rule(other)),
    })
}

/// The gathers, scatters, top-k, RoiAlign ([`Kind::Index`]) and dropout ([`Kind::Random`]).
pub(super) fn index(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { node, dy, dt, wants, .. } = *at;
    let x = |i: usize| at.x(i);
    Ok(match op {
        Op::Dropout(_) => {
            if crate::train::dropout_trains(b.g, node) {
                return Err("Dropout in training mode needs its mask: the training pipeline's train-mode pass \
                            makes it an ai.mpc::SeededDropout"
                    .into());
            }
            vec![Some(dy)]
        }
        // d/dx (x · mask / (1 - ratio)) = mask / (1 - ratio): where(mask, dy / (1 - ratio), 0).
        Op::SeededDropout(_) => {
            let ratio = match node.input(1) {
                None => 0.5,
                Some(r) => {
                    b.g.constant(r)
                        .and_then(|t| t.to_f64_vec().first().copied())
                        .ok_or("the dropout ratio must be a constant to differentiate")?
                }
            };
            let mask = *node.outputs().get(1).ok_or("the mask output is missing")?;
            let scale = b.scalar(1.0 / (1.0 - ratio), dt);
            let zero = b.scalar(0.0, dt);
            let scaled = b.op("scale", Op::Mul, &[dy, scale]);
            vec![Some(b.op("where", Op::Where, &[mask, scaled, zero]))]
        }
        // Embedding: the rows of dy are added at their indices (ai.mpc::GatherGrad).
        Op::Gather(a) => {
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("scatter", Op::GatherGrad(Box::new(AxisAttrs { axis: a.axis })), &[dy, x(1)?, s]))]
        }
        // d roi_align(x): each output's dy back to the corners its samples read, by their weights
        // (ai.mpc::RoiAlignGrad). The rois are positions, not trained (as in torchvision).
        Op::RoiAlign(a) => {
            let grad = Op::RoiAlignGrad(Box::new(a.clone()));
            vec![Some(b.op("roi_align_grad", grad, &[dy, x(0)?, x(1)?, x(2)?]))]
        }
        // dy added at each index's flat position (ai.mpc::GatherGrad over the flattened input).
        Op::GatherElements(a) => vec![Some(rules::gather_elements(b, node, a, dy)?)],
        // d topk: dy scattered to the picked positions (distinct within each line), 0 elsewhere.
        Op::TopK(a) => {
            let z = b.zeros_like(x(0)?)?;
            let at = *node.outputs().get(1).ok_or("TopK's indices output is missing")?;
            let scatter = Op::ScatterElements(ScatterElementsAttrs { axis: a.axis, ..Default::default() });
            vec![Some(b.ops("topk_grad", scatter, &[Some(z), Some(at), Some(dy)], 1)[0])]
        }
        Op::GatherND(a) => vec![Some(rules::gather_nd(b, node, a, dy)?)],
        Op::ScatterND(a) => rules::scatter(b, node, Op::ScatterND(a.clone()), a.reduction, dy, wants)?,
        Op::ScatterElements(a) => rules::scatter(b, node, Op::ScatterElements(a.clone()), a.reduction, dy, wants)?,
        other => return Err(no_rule(other)),
    })
}
