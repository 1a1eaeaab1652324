//! The gradient rules of the layers: products, convolutions, normalisations, pools, losses and
//! reductions ([`super::rule`] dispatches by family).

use super::*;

/// MatMul, Gemm and Einsum ([`Kind::MatMul`]).
pub(super) fn matmul(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { node, y, dy, dt, wants, .. } = *at;
    let x = |i: usize| at.x(i);
    let want = |i: usize| at.want(i);
    Ok(match op {
        // d(A·B) = dY·Bᵀ, Aᵀ·dY, summed over broadcast batch axes.
        Op::MatMul => {
            let (a, c) = (x(0)?, x(1)?);
            let (ra, rc) = (b.shape(a)?.rank(), b.shape(c)?.rank());
            if ra < 2 || rc < 2 {
                return Err("MatMul with a 1-D operand cannot be differentiated yet".into());
            }
            let ry = b.shape(y)?.rank();
            // Plain 2-D products take their transposes as Gemm flags, not as Transpose nodes.
            let gemm = |ta: bool, tb: bool| Op::Gemm(GemmAttrs { alpha: 1.0, beta: 0.0, transA: ta, transB: tb });
            let da = if !want(0) {
                None
            } else if ra == 2 && rc == 2 {
                Some(b.op("gemm", gemm(false, true), &[dy, c]))
            } else if rc == 2 {
                // A weight shared by every row: dY's rows times Bᵀ as one GEMM with B transposed
                // by the flag, not by a Transpose of the weight each step; then A's shape.
                let nn = fixed(&b.shape(y)?.dims()[ry - 1], "the output dimension")?;
                let sn = b.ints(&[-1, nn]);
                let d2 = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, sn]);
                let t = b.op("gemm", gemm(false, true), &[d2, c]);
                let sa = b.op("shape", Op::Shape(Default::default()), &[a]);
                Some(b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[t, sa]))
            } else {
                let ct = b.transpose_last(c, rc);
                let t = b.op("matmul", Op::MatMul, &[dy, ct]);
                Some(b.unbroadcast(t, a, y)?)
            };
            let dc = if want(1) {
                if ra == 2 && rc == 2 {
                    Some(b.op("gemm", gemm(true, false), &[a, dy]))
                } else if rc == 2 && ra > 2 {
                    // A weight shared by every row: flatten the batch into the rows, one GEMM.
                    let k = fixed(&b.shape(a)?.dims()[ra - 1], "the inner dimension")?;
                    let nn = fixed(&b.shape(y)?.dims()[ry - 1], "the output dimension")?;
                    let (sk, sn) = (b.ints(&[-1, k]), b.ints(&[-1, nn]));
                    let a2 = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[a, sk]);
                    let d2 = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, sn]);
                    Some(b.op("gemm", gemm(true, false), &[a2, d2]))
                } else {
                    let at = b.transpose_last(a, ra);
                    let t = b.op("matmul", Op::MatMul, &[at, dy]);
                    Some(b.unbroadcast(t, c, y)?)
                }
            } else {
                None
            };
            vec![da, dc]
        }
        // Y = α·op(A)·op(B) + β·C: dA, dB are Gemms of dY with the other operand, dC = β·ΣdY.
        Op::Gemm(a) => {
            let (ta, tb) = (a.transA, a.transB);
            let gemm = |ta: bool, tb: bool| Op::Gemm(GemmAttrs { alpha: a.alpha, beta: 0.0, transA: ta, transB: tb });
            let da = if want(0) {
                let v = if ta {
                    b.op("gemm", gemm(tb, true), &[x(1)?, dy])
                } else {
                    b.op("gemm", gemm(false, !tb), &[dy, x(1)?])
                };
                Some(v)
            } else {
                None
            };
            let db = if want(1) {
                let v = if tb {
                    b.op("gemm", gemm(true, ta), &[dy, x(0)?])
                } else {
                    b.op("gemm", gemm(!ta, false), &[x(0)?, dy])
                };
                Some(v)
            } else {
                None
            };
            let dc = match node.input(2) {
                Some(c) if want(2) => {
                    let t = if a.beta == 1.0 {
                        dy
                    } else {
                        let k = b.scalar(a.beta as f64, dt);
                        b.op("mul", Op::Mul, &[dy, k])
                    };
                    Some(b.unbroadcast(t, c, y)?)
                }
                _ => None,
            };
            vec![da, db, dc]
        }
        // d einsum(…, Xᵢ, …)/dXᵢ = the einsum of dY with the other operands, into Xᵢ's labels.
        Op::Einsum(a) => rules::einsum(b, node, &a.equation, dy, wants)?,
        other => return Err(no_rule(other)),
    })
}

/// The layers: convolutions, attention, normalisations, softmaxes and losses.
pub(super) fn layer(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { node, y, dy, wants, .. } = *at;
    let x = |i: usize| at.x(i);
    let want = |i: usize| at.want(i);
    Ok(match op {
        // d softmax: dx = y ⊙ (dy − Σ_axis dy ⊙ y), in ai.mpc::SoftmaxGrad.
        Op::Softmax(a) => {
            let y = saved_low_copy(b, y).unwrap_or(y);
            vec![Some(b.op("softmax", Op::SoftmaxGrad(Box::new(a.clone())), &[dy, y]))]
        }
        // Fused attention: ai.mpc::AttentionGrad recomputes the probabilities from Q, K, the mask
        // and the saved log-sum-exp, so none is kept between the passes.
        Op::Attention(a) => {
            if want(3) {
                return Err(
                    "the mask of a fused Attention depends on parameters, and its gradient is not computed".into()
                );
            }
            let lse = *node.outputs().get(1).ok_or("the log-sum-exp output is missing")?;
            let mut ins = vec![Some(dy), Some(x(0)?), Some(x(1)?), Some(x(2)?), Some(y), Some(lse)];
            ins.extend(node.input(3).map(Some));
            let outs = b.ops("attention", Op::AttentionGrad(a.clone()), &ins, 3);
            (0..3).map(|i| want(i).then_some(outs[i])).collect()
        }
        // d logsoftmax: dx = dy − e^y ⊙ Σ_axis dy.
        Op::LogSoftmax(a) => {
            let s = b.reduce_sum(dy, &[a.axis], true);
            let e = b.op("exp", Op::Exp, &[y]);
            let t = b.op("mul", Op::Mul, &[e, s]);
            vec![Some(b.op("sub", Op::Sub, &[dy, t]))]
        }
        // dX = ConvTranspose(dY, W), dW = correlation of X with dY, dB = ΣdY: ai.mpc::ConvGrad,
        // without its dB output where the Conv has no bias (no pass over dY for a sum no one
        // reads: ResNet's convolutions, each before a batch norm).
        Op::Conv(a) => {
            let n = if node.input(2).is_some() { 3 } else { 2 };
            let outs = b.ops("conv", Op::ConvGrad(a.clone()), &[Some(dy), Some(x(0)?), Some(x(1)?)], n);
            vec![Some(outs[0]), Some(outs[1]), node.input(2).map(|_| outs[2])]
        }
        // The adjoint of Conv: dX = Conv(dY, W), dW through ai.mpc::ConvGrad, dB = ΣdY.
        Op::ConvTranspose(a) => rules::conv_transpose(b, node, a, dy, wants)?,
        // Batch statistics: dX = (γ/σ)/N · (N·dY − ΣdY − x̂·Σ(dY·x̂)), dγ = Σ dY·x̂, dβ = ΣdY.
        Op::BatchNormalization(a) => {
            if !a.training_mode {
                return Err("BatchNormalization in inference mode (training_mode=0) has no batch statistics to \
                            differentiate: the training pipeline's train-mode pass switches it to training mode"
                    .into());
            }
            let eps = mpc_ir::ops::EpsilonAttrs { epsilon: a.epsilon };
            let outs = b.ops("bn", Op::BatchNormalizationGrad(Box::new(eps)), &[Some(dy), Some(x(0)?), Some(x(1)?)], 3);
            vec![Some(outs[0]), Some(outs[1]), Some(outs[2])]
        }
        // Per row: dX = (1/σ)/n · (n·ĝ − Σĝ − x̂·Σ(ĝ·x̂)) with ĝ = γ·dY; dγ = Σ dY·x̂; dβ = ΣdY.
        Op::LayerNormalization(a) => {
            let outs =
                b.ops("ln", Op::LayerNormalizationGrad(Box::new(a.clone())), &[Some(dy), Some(x(0)?), Some(x(1)?)], 3);
            vec![Some(outs[0]), Some(outs[1]), node.input(2).map(|_| outs[2])]
        }
        // dX = LayerNormalizationGrad per instance or group of γ·dY, dγ = Σ dY·x̂, dβ = ΣdY.
        Op::InstanceNormalization(a) => rules::channel_norm(b, node, dy, wants, a.epsilon, None)?,
        Op::GroupNormalization(a) => rules::channel_norm(b, node, dy, wants, a.epsilon, Some(a.num_groups))?,
        // d lrn: dy·s^(−β) less the windowed term through the normaliser s.
        Op::LRN(a) => vec![Some(rules::lrn(b, node, a, dy)?)],
        // d CE/d scores = (softmax(scores) − onehot(label)) · weight / N (ai.mpc::SoftmaxCrossEntropyLossGrad).
        Op::SoftmaxCrossEntropyLoss(a) => {
            let mut ins = vec![Some(dy), Some(x(0)?), Some(x(1)?)];
            ins.extend(node.input(2).map(Some));
            vec![Some(b.ops("sce", Op::SoftmaxCrossEntropyLossGrad(Box::new(a.clone())), &ins, 1)[0])]
        }
        // d NLL/d input = −weight / N at the label, 0 elsewhere (ai.mpc::NegativeLogLikelihoodLossGrad).
        Op::NegativeLogLikelihoodLoss(a) => {
            let mut ins = vec![Some(dy), Some(x(0)?), Some(x(1)?)];
            ins.extend(node.input(2).map(Some));
            vec![Some(b.ops("nll", Op::NegativeLogLikelihoodLossGrad(Box::new(a.clone())), &ins, 1)[0])]
        }
        other => return Err(no_rule(other)),
    })
}

/// The reductions, pools and scans ([`Kind::Reduce`], [`Kind::Pool`], [`Kind::Scan`]).
pub(super) fn reduce(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { node, y, dy, dt, .. } = *at;
    let x = |i: usize| at.x(i);
    Ok(match op {
        // The window's maximum receives dy (ai.mpc::MaxPoolGrad).
        Op::MaxPool(a) => vec![Some(b.op("maxpool", Op::MaxPoolGrad(a.clone()), &[dy, x(0)?]))],
        // The maximum of each plane receives dy: MaxPoolGrad over a window of the whole plane (the first
        // maximum at ties, as for MaxPool).
        Op::GlobalMaxPool => {
            let xs = b.shape(x(0)?)?;
            let kernel = xs.dims()[2..].iter().map(|d| fixed(d, "the pooled dims")).collect::<Result<_, _>>()?;
            let attrs = PoolAttrs { kernel_shape: kernel, ..Default::default() };
            vec![Some(b.op("maxpool", Op::MaxPoolGrad(Box::new(attrs)), &[dy, x(0)?]))]
        }
        // dy spread evenly over each window (ai.mpc::AveragePoolGrad).
        Op::AveragePool(a) => vec![Some(b.op("avgpool", Op::AveragePoolGrad(a.clone()), &[dy, x(0)?]))],
        // d mean over H·W = dy / (H·W), broadcast back.
        Op::GlobalAveragePool => {
            let xs = b.shape(x(0)?)?;
            let mut count = 1i64;
            for d in &xs.dims()[2..] {
                count *= fixed(d, "the pooled dims")?;
            }
            let k = b.scalar(count as f64, dt);
            let t = b.op("div", Op::Div, &[dy, k]);
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("expand", Op::Expand, &[t, s]))]
        }
        // d Σ = dy broadcast back over the reduced axes (÷ count for the mean).
        Op::ReduceSum(a) | Op::ReduceMean(a) => {
            let x0 = x(0)?;
            let xs = b.shape(x0)?;
            let Some(axes) = rules::reduced_axes(b, node, a)? else { return Ok(vec![Some(dy)]) };
            let mut t = rules::keep(b, dy, &axes, a.keepdims);
            if matches!(op, Op::ReduceMean(_)) {
                let count: Option<i64> = axes.iter().map(|&ax| xs.dims()[ax].fixed().map(|d| d as i64)).product();
                let k = match count {
                    Some(c) => b.scalar(c as f64, dt),
                    // A symbolic dim (the batch): the count is size(x) / size(y) at run time.
                    None => {
                        let (nx, ny) = (b.op("size", Op::Size, &[x0]), b.op("size", Op::Size, &[y]));
                        let c = b.op("count", Op::Div, &[nx, ny]);
                        b.cast(c, dt)
                    }
                };
                t = b.op("div", Op::Div, &[t, k]);
            }
            let s = b.shape_of(x0);
            vec![Some(b.op("expand", Op::Expand, &[t, s]))]
        }
        // d max, min, Σx², Σ|x|, √Σx², log Σeˣ, Πx: each a function of x, y and dy at x's rank.
        op @ (mpc_ir::reduce_ops!()) => {
            let (_, a) = op.reduction().expect("a reduction");
            vec![Some(rules::reduce(b, node, a, dy)?)]
        }
        // d cumsum(x) = the cumulative sum of dy the other way (exclusive stays exclusive).
        Op::CumSum(a) => {
            let back = Op::CumSum(CumSumAttrs { exclusive: a.exclusive, reverse: !a.reverse });
            vec![Some(b.op("cumsum", back, &[dy, x(1)?]))]
        }
        // d cumprod(x): each x_j's share of every later product, without dividing by x_j (which
        // may be 0): ai.mpc::CumProdGrad (docs/ai-mpc-ops.md).
        Op::CumProd(a) => vec![Some(b.op("cumprod_grad", Op::CumProdGrad(Box::new(a.clone())), &[dy, x(0)?, x(1)?]))],
        other => return Err(no_rule(other)),
    })
}
