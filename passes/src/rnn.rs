//! Recurrent layers unrolled: LSTM and GRU over a sequence of known length become the matrix
//! products and element-wise gates of each step.
//!
//! Exporters write `nn.LSTM`/`nn.GRU` as one ONNX node. Unrolled for the sequence length the model
//! declares, every step is MatMul, Add, Sigmoid, Tanh and Mul: ops that the runtime executes, that
//! the precision pass colours (the products low, the cell state as the policy says) and that the
//! training compiler differentiates. The input projection of every step is one MatMul over the
//! whole sequence. Supported: the default activations, every direction, with or without biases and
//! initial states, layout 0 and 1; GRU either way of `linear_before_reset`. Not supported (an error
//! naming the node): `sequence_lens`, peepholes, `clip`, `input_forget`, other activations, and a
//! sequence length that is not a fixed size.

use mpc_ir::attr::Attr;
use mpc_ir::ops::{AxisAttrs, ConcatAttrs, ConstantOfShapeAttrs, SplitAttrs, TransposeAttrs};
use mpc_ir::{DType, Dim, Graph, NodeId, Op, Tensor, ValueId};

use crate::train::build::Builder;
use crate::{infer_types, Changed, Context, Pass, PassError, Result};

/// The longest sequence unrolled: each step is a handful of nodes.
const MAX_STEPS: u64 = 4096;

pub struct UnrollRnn;

impl Pass for UnrollRnn {
    fn name(&self) -> &'static str {
        "unroll-rnn"
    }

    /// Training refuses a node it cannot unroll, naming it (its gradient needs the steps); an
    /// inference compile leaves such a node as it was (a sequence length known only when the dims
    /// are bound: `run` binds them from its inputs first).
    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let nodes: Vec<NodeId> = g
            .topo_order()?
            .into_iter()
            .filter(|&n| matches!(&g.node(n).op, Op::Opaque(o) if o.domain.is_empty() && matches!(o.op_type.as_str(), "LSTM" | "GRU")))
            .collect();
        let mut changed = Changed::No;
        // In order: a stacked layer's input is the unrolled layer before it, typed before it is read.
        for n in nodes {
            // `unroll` checks everything before it changes the graph.
            match unroll(g, n) {
                Ok(()) => {
                    changed = Changed::Yes;
                    infer_types(g)?;
                }
                Err(msg) if cx.train.is_some() => return Err(PassError::Node { node: g.node_label(n), msg }),
                Err(_) => {}
            }
        }
        Ok(changed)
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Cell {
    Lstm,
    /// GRU; `true` when the reset gate multiplies the hidden state's product (`linear_before_reset`).
    Gru(bool),
}

impl Cell {
    fn gates(self) -> i64 {
        match self {
            Cell::Lstm => 4,
            Cell::Gru(_) => 3,
        }
    }
}

/// An LSTM or GRU node, read and checked before anything changes.
struct Layer {
    cell: Cell,
    hidden: i64,
    layout: i64,
    /// Each direction: `true` for reverse.
    directions: Vec<bool>,
    x: ValueId,
    w: ValueId,
    r: ValueId,
    bias: Option<ValueId>,
    h0: Option<ValueId>,
    c0: Option<ValueId>,
    outputs: Vec<ValueId>,
    name: String,
    dtype: DType,
    steps: i64,
}

/// The cell, hidden size, layout and directions of an LSTM or GRU, refused where mpc does not
/// unroll them.
fn layer_attrs(o: &mpc_ir::ops::Opaque) -> Result<(Cell, i64, i64, Vec<bool>), String> {
    let attr = |k: &str| o.attrs.iter().find(|(name, _)| name == k).map(|(_, a)| a.clone());
    let int = |k: &str, default: i64| match attr(k) {
        Some(Attr::Int(v)) => Ok(v),
        None => Ok(default),
        Some(a) => Err(format!("attribute `{k}` is a {}, not an int", a.kind())),
    };
    let cell = match o.op_type.as_str() {
        "LSTM" => Cell::Lstm,
        _ => Cell::Gru(int("linear_before_reset", 0)? != 0),
    };
    let hidden = int("hidden_size", 0)?;
    if hidden <= 0 {
        return Err("`hidden_size` must be given and positive".into());
    }
    let layout = int("layout", 0)?;
    let directions: Vec<bool> = match attr("direction") {
        None => vec![false],
        Some(Attr::String(d)) => match d.as_str() {
            "forward" => vec![false],
            "reverse" => vec![true],
            "bidirectional" => vec![false, true],
            d => return Err(format!("direction `{d}` is not forward, reverse or bidirectional")),
        },
        Some(a) => return Err(format!("attribute `direction` is a {}, not a string", a.kind())),
    };
    let defaults: &[&str] = match cell {
        Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
        Cell::Gru(_) => &["Sigmoid", "Tanh"],
    };
    match attr("activations") {
        None => {}
        Some(Attr::Strings(a))
            if a.chunks(defaults.len()).all(|c| c.iter().map(String::as_str).eq(defaults.iter().copied())) => {}
        Some(_) => return Err(format!("only the default activations ({}) can be unrolled", defaults.join(", "))),
    }
    for k in ["clip", "activation_alpha", "activation_beta"] {
        if attr(k).is_some() {
            return Err(format!("attribute `{k}` cannot be unrolled"));
        }
    }
    if int("input_forget", 0)? != 0 {
        return Err("`input_forget` cannot be unrolled".into());
    }
    if !(0..=1).contains(&layout) {
        return Err(format!("layout {layout} is not 0 or 1"));
    }
    Ok((cell, hidden, layout, directions))
}

fn read_layer(g: &Graph, n: NodeId) -> Result<Layer, String> {
    let Op::Opaque(o) = &g.node(n).op else { unreachable!("selected opaque") };
    let (cell, hidden, layout, directions) = layer_attrs(o)?;
    let node = g.node(n);
    let input = |i: usize| node.input(i);
    if input(4).is_some() {
        return Err("`sequence_lens` cannot be unrolled: every sequence must have the full length".into());
    }
    if cell == Cell::Lstm && input(7).is_some() {
        return Err("peepholes cannot be unrolled".into());
    }
    let (x, w, r, bias, h0, c0) = (
        input(0).ok_or("no input X")?,
        input(1).ok_or("no input W")?,
        input(2).ok_or("no input R")?,
        input(3),
        input(5),
        if cell == Cell::Lstm { input(6) } else { None },
    );
    let outputs = node.outputs().to_vec();
    let name = if node.name.is_empty() { g.name(outputs[0]).to_string() } else { node.name.clone() };
    let xs = g.ty(x).shape.clone().ok_or("the shape of X is unknown")?;
    let dtype = g.ty(x).dtype.ok_or("the dtype of X is unknown")?;
    if xs.rank() != 3 {
        return Err(format!("X is {xs}, not of rank 3"));
    }
    let steps = match &xs.dims()[layout as usize] {
        Dim::Fixed(0) => return Err("a sequence of 0 steps has nothing to unroll".into()),
        Dim::Fixed(s) if *s <= MAX_STEPS => *s as i64,
        Dim::Fixed(s) => return Err(format!("a sequence of {s} steps is more than the {MAX_STEPS} mpc unrolls")),
        d => {
            return Err(format!(
                "the sequence length is `{d}`: only a fixed length can be unrolled (`train` binds it from the data; `compile --dim {d}=N` gives it)"
            ))
        }
    };

    Ok(Layer { cell, hidden, layout, directions, x, w, r, bias, h0, c0, outputs, name, dtype, steps })
}

fn unroll(g: &mut Graph, n: NodeId) -> Result<(), String> {
    let l = read_layer(g, n)?;
    let (cell, layout, outputs) = (l.cell, l.layout, l.outputs.clone());
    let mut b = Builder::new(g);
    b.at(&l.name);
    // Time-major X: [steps, batch, input].
    let x = if layout == 1 { transpose(&mut b, l.x, &[1, 0, 2]) } else { l.x };
    let (mut ys, mut hs, mut cs) = (Vec::new(), Vec::new(), Vec::new());
    for (d, &reverse) in l.directions.iter().enumerate() {
        let (y, h, c) = direction(&mut b, &l, x, d, reverse);
        ys.push(y);
        hs.push(h);
        cs.extend(c);
    }
    let concat = |b: &mut Builder, what: &str, parts: &[ValueId], axis: i64| match parts {
        [one] => *one,
        _ => b.op(what, Op::Concat(ConcatAttrs { axis }), parts),
    };
    let mut y = concat(&mut b, "y", &ys, 1);
    let mut yh = concat(&mut b, "y_h", &hs, 0);
    if layout == 1 {
        // Batch-major outputs: Y [batch, steps, directions, hidden], Y_h [batch, directions, hidden].
        y = transpose(&mut b, y, &[2, 0, 1, 3]);
        yh = transpose(&mut b, yh, &[1, 0, 2]);
    }
    let mut new = vec![y, yh];
    if cell == Cell::Lstm {
        let yc = concat(&mut b, "y_c", &cs, 0);
        new.push(if layout == 1 { transpose(&mut b, yc, &[1, 0, 2]) } else { yc });
    }
    let g = b.g;
    for (&old, new) in outputs.iter().zip(new) {
        g.replace_uses(old, new);
    }
    g.remove_node(n);
    Ok(())
}

/// One direction unrolled over the time-major `x`: its Y as `[steps, 1, batch, hidden]`, its last
/// hidden state as `[1, batch, hidden]`, and an LSTM's last cell state so.
fn direction(b: &mut Builder, l: &Layer, x: ValueId, d: usize, reverse: bool) -> (ValueId, ValueId, Option<ValueId>) {
    let (cell, h, dtype) = (l.cell, l.hidden, l.dtype);
    let pick = |b: &mut Builder, t: ValueId| {
        let i = scalar_index(b, d as i64);
        b.op("dir", Op::Gather(AxisAttrs { axis: 0 }), &[t, i])
    };
    let wd = pick(b, l.w);
    let rd = pick(b, l.r);
    let wt = transpose(b, wd, &[1, 0]);
    let rt = transpose(b, rd, &[1, 0]);
    // The input projection of every step at once: [steps, batch, gates·hidden].
    let mut xw = b.op("x_proj", Op::MatMul, &[x, wt]);
    let mut rb = None;
    if let Some(bias) = l.bias {
        let bd = pick(b, bias);
        let parts = b.ops("bias", Op::Split(SplitAttrs { axis: 0, num_outputs: Some(2) }), &[Some(bd)], 2);
        match cell {
            // Both biases add before the gates.
            Cell::Lstm => {
                let sum = b.op("bias", Op::Add, &[parts[0], parts[1]]);
                xw = b.op("x_proj", Op::Add, &[xw, sum]);
            }
            Cell::Gru(_) => {
                xw = b.op("x_proj", Op::Add, &[xw, parts[0]]);
                rb = Some(parts[1]);
            }
        }
    }
    let state = |b: &mut Builder, init: Option<ValueId>| match init {
        Some(v) => pick(b, v),
        None => zeros(b, x, h, dtype),
    };
    let mut hcur = state(b, l.h0);
    let mut ccur = if cell == Cell::Lstm { state(b, l.c0) } else { hcur };
    let mut step_ys = Vec::with_capacity(l.steps as usize);
    let order: Vec<i64> = if reverse { (0..l.steps).rev().collect() } else { (0..l.steps).collect() };
    for t in order {
        let i = scalar_index(b, t);
        let xt = b.op("x", Op::Gather(AxisAttrs { axis: 0 }), &[xw, i]);
        let mut hr = b.op("h_proj", Op::MatMul, &[hcur, rt]);
        if let Some(rb) = rb {
            hr = b.op("h_proj", Op::Add, &[hr, rb]);
        }
        match cell {
            Cell::Lstm => (hcur, ccur) = lstm_step(b, xt, hr, ccur),
            Cell::Gru(linear_before_reset) => hcur = gru_step(b, Gru { xt, hr, hcur, rt, rb, h, linear_before_reset }),
        }
        step_ys.push(hcur);
    }
    if reverse {
        step_ys.reverse();
    }
    // Y of this direction: [steps, 1, batch, hidden].
    let axes01 = b.ints(&[0, 1]);
    let axis0 = b.ints(&[0]);
    let rows: Vec<ValueId> = step_ys.iter().map(|&y| b.op("y", Op::Unsqueeze, &[y, axes01])).collect();
    let y = b.op("y", Op::Concat(ConcatAttrs { axis: 0 }), &rows);
    let yh = b.op("y_h", Op::Unsqueeze, &[hcur, axis0]);
    let yc = (cell == Cell::Lstm).then(|| b.op("y_c", Op::Unsqueeze, &[ccur, axis0]));
    (y, yh, yc)
}

/// The gates split from a `[batch, gates·hidden]` sum.
fn split_gates(b: &mut Builder, cell: Cell, v: ValueId) -> Vec<ValueId> {
    let k = cell.gates();
    b.ops("gates", Op::Split(SplitAttrs { axis: 1, num_outputs: Some(k) }), &[Some(v)], k as usize)
}

/// An LSTM step from the step's input projection `xt` and hidden projection `hr`: i, o, f, c =
/// σ, σ, σ, tanh of x·Wᵀ + h·Rᵀ + b; c ← f·c + i·c̃; h ← o·tanh(c). The new (h, c).
fn lstm_step(b: &mut Builder, xt: ValueId, hr: ValueId, ccur: ValueId) -> (ValueId, ValueId) {
    let gates = b.op("gates", Op::Add, &[xt, hr]);
    let p = split_gates(b, Cell::Lstm, gates);
    let (ig, og, fg) =
        (b.op("i", Op::Sigmoid, &[p[0]]), b.op("o", Op::Sigmoid, &[p[1]]), b.op("f", Op::Sigmoid, &[p[2]]));
    let cand = b.op("c_new", Op::Tanh, &[p[3]]);
    let keep = b.op("c", Op::Mul, &[fg, ccur]);
    let write = b.op("c", Op::Mul, &[ig, cand]);
    let ccur = b.op("c", Op::Add, &[keep, write]);
    let tc = b.op("h", Op::Tanh, &[ccur]);
    (b.op("h", Op::Mul, &[og, tc]), ccur)
}

/// What a GRU step reads: the step's input and hidden projections, the hidden state, Rᵀ and the
/// recurrent bias, the hidden size, and which way the reset gate applies.
struct Gru {
    xt: ValueId,
    hr: ValueId,
    hcur: ValueId,
    rt: ValueId,
    rb: Option<ValueId>,
    h: i64,
    linear_before_reset: bool,
}

/// A GRU step: z, r = σ(x·Wᵀ + h·Rᵀ + b); n = tanh(x·W_nᵀ + r·(h·R_nᵀ + Rb_n)) (linear before
/// reset) or tanh(x·W_nᵀ + (r·h)·R_nᵀ + Rb_n); h ← n + z·(h − n). The new h.
fn gru_step(b: &mut Builder, s: Gru) -> ValueId {
    let Gru { xt, hr, hcur, rt, rb, h, linear_before_reset } = s;
    let px = split_gates(b, Cell::Gru(linear_before_reset), xt);
    let ph = split_gates(b, Cell::Gru(linear_before_reset), hr);
    let zs = b.op("z", Op::Add, &[px[0], ph[0]]);
    let rs = b.op("r", Op::Add, &[px[1], ph[1]]);
    let (zg, rg) = (b.op("z", Op::Sigmoid, &[zs]), b.op("r", Op::Sigmoid, &[rs]));
    let hn = if linear_before_reset {
        b.op("n", Op::Mul, &[rg, ph[2]])
    } else {
        let rh = b.op("n", Op::Mul, &[rg, hcur]);
        let starts = b.ints(&[2 * h]);
        let ends = b.ints(&[3 * h]);
        let axis = b.ints(&[1]);
        let rn = b.op("r_n", Op::Slice, &[rt, starts, ends, axis]);
        let p = b.op("n", Op::MatMul, &[rh, rn]);
        match rb {
            Some(rb) => {
                let bn = b.op("rb_n", Op::Slice, &[rb, starts, ends]);
                b.op("n", Op::Add, &[p, bn])
            }
            None => p,
        }
    };
    let ns = b.op("n", Op::Add, &[px[2], hn]);
    let ng = b.op("n", Op::Tanh, &[ns]);
    let diff = b.op("h", Op::Sub, &[hcur, ng]);
    let upd = b.op("h", Op::Mul, &[zg, diff]);
    b.op("h", Op::Add, &[ng, upd])
}

fn transpose(b: &mut Builder, x: ValueId, perm: &[i64]) -> ValueId {
    b.op("transpose", Op::Transpose(TransposeAttrs { perm: Some(perm.to_vec()) }), &[x])
}

/// A rank-0 int64 index (Gather with it drops the axis).
fn scalar_index(b: &mut Builder, i: i64) -> ValueId {
    b.init(&format!("{}.t{i}", b.base), Tensor::from_i64(vec![], &[i]))
}

/// Zeros `[batch, hidden]` for a missing initial state, the batch read from X `[steps, batch, _]`.
fn zeros(b: &mut Builder, x: ValueId, hidden: i64, dtype: DType) -> ValueId {
    let shape = b.op("shape", Op::Shape(Default::default()), &[x]);
    let (one, two) = (b.ints(&[1]), b.ints(&[2]));
    let batch = b.op("batch", Op::Slice, &[shape, one, two]);
    let h = b.ints(&[hidden]);
    let dims = b.op("state_shape", Op::Concat(ConcatAttrs { axis: 0 }), &[batch, h]);
    let value = Tensor::from_f64_as(dtype, vec![1], &[0.0]);
    b.op("state0", Op::ConstantOfShape(Box::new(ConstantOfShapeAttrs { value: Some(value) })), &[dims])
}
