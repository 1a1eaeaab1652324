//! A model exported with a fixed batch made to train with any: [`free_batch`].

use std::collections::HashSet;

use mpc_ir::ops::Arith;
use mpc_ir::{Dim, Graph, Kind, Op, Shape, Tensor, TypeInfo, ValueId};
use mpc_runtime::HostTensor;

/// Gives every graph input a symbolic leading dim `batch`, so that a model exported with a fixed
/// batch trains with any batch size (and a short last batch). Returns the export's batch when
/// the inputs had one.
///
/// An exporter also bakes that batch into the graph: declared output shapes, the shape operands
/// of Reshape, Expand and ConstantOfShape, and constants expanded to it (token-type ids, a class
/// token). Declared leading dims equal to it are forgotten (inference recomputes them); a shape
/// operand that starts with it starts with -1 (Reshape; 0 when it has a -1 already) or 1
/// (Expand, ConstantOfShape: broadcasting restores the batch); a constant (not a parameter) whose
/// leading dim is it and whose slices along that dim are all equal becomes its first slice. What
/// still holds the batch fails inference, naming its node.
pub fn free_batch(g: &mut Graph) -> Option<u64> {
    let mut batch = None;
    for v in g.inputs().to_vec() {
        let ty = g.ty(v).clone();
        if let (Some(d), Some(s)) = (ty.dtype, &ty.shape) {
            if let Some(&Dim::Fixed(b)) = s.dims().first() {
                let mut dims = s.dims().to_vec();
                dims[0] = Dim::sym("batch");
                g.set_ty(v, TypeInfo::new(d, Shape(dims)));
                batch.get_or_insert(b);
            }
        }
    }
    let b = batch.filter(|&b| b > 1)?;
    for v in g.value_ids().collect::<Vec<_>>() {
        if matches!(g.value(v).def(), mpc_ir::Def::Node(..)) {
            if let Some(s) = g.ty(v).shape.as_ref().filter(|s| s.dims().first() == Some(&Dim::Fixed(b))) {
                let mut ty = g.ty(v).clone();
                ty.shape = Some(Shape([&[Dim::Unknown], &s.dims()[1..]].concat()));
                g.set_ty(v, ty);
            }
        }
    }
    fold_shape_arithmetic(g);
    // A parameter is the model's own, whatever its shape: only constants are rewritten (in a
    // dynamo export, those its signature does not name: a class token the exporter expanded to
    // the batch trains as its first slice, which the broadcast gives every sample).
    let params: HashSet<ValueId> = match mpc_passes::train::ExportSignature::of(g) {
        Some(sig) => g.initializers().filter(|&v| sig.names_parameter(g.name(v))).collect(),
        None => mpc_passes::train::trainable(g, &Default::default()).into_iter().collect(),
    };
    for n in g.node_ids().collect::<Vec<_>>() {
        for slot in 0..g.node(n).inputs().len() {
            let input = g.node(n).input(slot).filter(|v| !params.contains(v));
            let Some(c) = input.and_then(|v| g.constant(v)).cloned() else { continue };
            let name = g.unique_name(&format!("{}.any_batch", g.name(g.node(n).input(slot).expect("read above"))));
            let v = match freed_of(g, n, slot, &c, b) {
                Some(Freed::Constant(t)) => g.add_initializer(&name, t),
                Some(Freed::Target(dims, at)) => batch_target(g, &name, &dims, &at),
                None => continue,
            };
            g.set_input(n, slot, Some(v));
        }
    }
    Some(b)
}

/// What a constant holding the export's batch becomes.
enum Freed {
    Constant(Tensor),
    /// An Expand's target whose entries at these positions are the batch of the data, read from
    /// the first input's shape when the step runs.
    Target(Vec<i64>, Vec<usize>),
}

/// A shape `dims` with the entries at `at` the leading dim of the graph's first input: Concat of
/// the constant runs and `Shape(input)[0:1]`.
fn batch_target(g: &mut Graph, name: &str, dims: &[i64], at: &[usize]) -> ValueId {
    let input = g.inputs()[0];
    let shape_op = Op::Shape(mpc_ir::ops::ShapeAttrs { start: 0, end: Some(1) });
    let batch = g.add_op(&format!("{name}.batch"), shape_op, &[Some(input)], 1).1[0];
    let mut parts = Vec::new();
    let mut run = Vec::new();
    for (i, &d) in dims.iter().enumerate() {
        if at.contains(&i) {
            if !run.is_empty() {
                let c = g.add_initializer(
                    &g.unique_name(&format!("{name}.dims")),
                    Tensor::from_i64(vec![run.len() as u64], &run),
                );
                parts.push(Some(c));
                run.clear();
            }
            parts.push(Some(batch));
        } else {
            run.push(d);
        }
    }
    if !run.is_empty() {
        let c =
            g.add_initializer(&g.unique_name(&format!("{name}.dims")), Tensor::from_i64(vec![run.len() as u64], &run));
        parts.push(Some(c));
    }
    g.add_op(name, Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &parts, 1).1[0]
}

/// Constant `c`, read at `slot` of node `n`, with the export's batch `b` freed, or `None` where it
/// holds none: a shape operand's batch entry becomes -1 or 0 (Reshape), the data's batch (Expand,
/// at any position whose input dim is 1) or 1 (ConstantOfShape, leading: broadcasting restores
/// it); a constant of one value (zeros, ones) 1 along every axis of size `b` where its reader
/// broadcasts (Expand, the element-wise ops, an RNN's initial state); and a constant of equal
/// slices along a leading `b` its first slice.
fn freed_of(g: &mut Graph, n: mpc_ir::NodeId, slot: usize, c: &Tensor, b: u64) -> Option<Freed> {
    let op = &g.node(n).op;
    let broadcasts = match op.kind() {
        Kind::Arith(a) => matches!(a, Arith::Add | Arith::Sub | Arith::Mul | Arith::Div),
        Kind::Movement | Kind::Select => matches!(op, Op::Expand | Op::Where),
        Kind::Opaque => matches!(op.op_type(), "LSTM" | "GRU") && matches!(slot, 5 | 6),
        _ => false,
    };
    if broadcasts && c.all_equal() && c.shape().contains(&b) && !(matches!(g.node(n).op, Op::Expand) && slot == 1) {
        let shape: Vec<u64> = c.shape().iter().map(|&d| if d == b { 1 } else { d }).collect();
        let n = shape.iter().product::<u64>() as usize;
        let one = c.bytes().slice(..c.dtype().size());
        let bytes: Vec<u8> = one.iter().copied().cycle().take(n * one.len()).collect();
        return Tensor::from_bytes(c.dtype(), shape, bytes.into()).ok().map(Freed::Constant);
    }
    let t = freed_operand(g, n, slot, c, b)?;
    Some(t)
}

/// [`freed_of`] for shape operands and equal slices.
fn freed_operand(g: &mut Graph, n: mpc_ir::NodeId, slot: usize, c: &Tensor, b: u64) -> Option<Freed> {
    let b = b as i64;
    match (&g.node(n).op, slot) {
        (Op::Reshape(a), 1) => {
            let mut dims = c.to_i64_vec().filter(|d| d.first() == Some(&b))?;
            dims[0] = match (dims.contains(&-1), a.allowzero) {
                (false, _) => -1,
                (true, false) => 0,
                // `allowzero` makes 0 a size: it means "copy" again only where no entry is 0.
                (true, true) if !dims.contains(&0) => {
                    *g.node_op_mut(n) = Op::Reshape(mpc_ir::ops::ReshapeAttrs { allowzero: false });
                    0
                }
                (true, true) => return None,
            };
            Some(Freed::Constant(Tensor::from_i64(vec![dims.len() as u64], &dims)))
        }
        (Op::Expand, 1) => {
            let mut dims = c.to_i64_vec()?;
            let x = g.node(n).input(0).and_then(|x| g.ty(x).shape.clone());
            let rank = dims.len();
            let one_in_x = |i: usize| match &x {
                // Right-aligned broadcasting: a dim the input lacks, or has as 1.
                Some(s) => i + s.rank() < rank || s.dims()[i + s.rank() - rank].fixed() == Some(1),
                None => i == 0,
            };
            let at: Vec<usize> = (0..rank).filter(|&i| dims[i] == b && one_in_x(i)).collect();
            (!at.is_empty()).then(|| Freed::Target(std::mem::take(&mut dims), at))
        }
        (Op::ConstantOfShape(_), 0) => {
            let mut dims = c.to_i64_vec().filter(|d| d.first() == Some(&b))?;
            dims[0] = 1;
            Some(Freed::Constant(Tensor::from_i64(vec![dims.len() as u64], &dims)))
        }
        _ => first_of_equal_slices(c, b as u64).map(Freed::Constant),
    }
}

/// Folds the integer shape arithmetic on constants (`Where(Equal(C, -1), 1, C)` around an Expand's
/// target): what an export computes from the batch it holds becomes a constant that can be freed.
/// Integer results only (the types are not inferred yet): float constants stay as written.
fn fold_shape_arithmetic(g: &mut Graph) {
    let ints = |outs: &[HostTensor]| outs.iter().all(|t| !t.dtype().is_float());
    let limit = mpc_runtime::device::DeviceOptions::default().memory();
    while crate::run::fold_constants(g, &HashSet::new(), &ints, limit).unwrap_or(0) > 0 {}
}

/// The first slice of `t` along its leading dim, when that dim is `b` and every slice equals it.
/// A vector is left alone: its one dim is as likely a size of the model's own (channels, groups)
/// as the batch.
fn first_of_equal_slices(t: &Tensor, b: u64) -> Option<Tensor> {
    if t.shape().len() < 2 || t.shape().first() != Some(&b) {
        return None;
    }
    let bytes = t.bytes();
    let slice = bytes.len() / b as usize;
    if slice == 0 || bytes.chunks(slice).any(|c| c != &bytes[..slice]) {
        return None;
    }
    let shape = [&[1], &t.shape()[1..]].concat();
    Tensor::from_bytes(t.dtype(), shape, bytes.slice(..slice)).ok()
}
