//! The sharded optimizer state (`--shard-optimizer`, ZeRO stage 1) as graph rewrites.
//!
//! Each parameter of `n` elements is cut, flattened and padded with zeros, into `world` blocks
//! of `s = ⌈n / world⌉`; a rank keeps block `rank` of the master weight, of its moments and of
//! its low-precision copy as its state, so its training state is `1 / world` of the whole. The
//! step starts by gathering the blocks of the weights the forward pass reads
//! (`ai.mpc::AllGather`, then a Slice of the padding and a Reshape), reduce-scatters each
//! gradient (`ai.mpc::ReduceScatter`, the mean in FP32: the rank's block of what the all-reduce
//! of the unsharded step gives) and updates its blocks, element by element as the unsharded
//! update does. Every rank runs the same program; only the initial values of its state blocks
//! are its own.

use mpc_ir::ops::{AllGatherAttrs, CollectiveReduction, ReduceScatterAttrs};
use mpc_ir::{DType, Graph, Op, Tensor, TypeInfo, ValueId};

use super::build::Builder;
use crate::{PassError, Result};

/// This rank's place among the ranks that share the optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateShard {
    pub rank: usize,
    pub world: usize,
}

impl StateShard {
    /// Elements per block of a tensor of `numel` elements (at least one).
    pub fn block_len(&self, numel: u64) -> u64 {
        numel.div_ceil(self.world.max(1) as u64).max(1)
    }

    /// This rank's block of `t`, flattened and padded with zeros to `world` blocks.
    pub fn block(&self, t: &Tensor) -> Tensor {
        let s = self.block_len(t.numel()) as usize;
        let e = t.dtype().size();
        let bytes = t.bytes();
        let mut out = vec![0u8; s * e];
        let start = (self.rank * s * e).min(bytes.len());
        let end = ((self.rank + 1) * s * e).min(bytes.len());
        out[..end - start].copy_from_slice(&bytes[start..end]);
        Tensor::from_bytes(t.dtype(), vec![s as u64], out.into()).expect("a block's bytes fit its shape")
    }
}

/// The value of shape `shape` whose blocks the ranks hold as `block`: their all-gather, its
/// padding sliced off, reshaped.
pub(super) fn gathered(b: &mut Builder, block: ValueId, shape: &[u64], z: StateShard) -> ValueId {
    let n: u64 = shape.iter().product();
    let attrs = AllGatherAttrs { world: z.world as i64 };
    let mut all = b.op("all_gather", Op::AllGather(Box::new(attrs)), &[block]);
    if z.block_len(n) * z.world as u64 != n {
        let (start, end, axis) = (b.ints(&[0]), b.ints(&[n as i64]), b.ints(&[0]));
        all = b.op("unpad", Op::Slice, &[all, start, end, axis]);
    }
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let to = b.ints(&dims);
    b.op("unflatten", Op::Reshape(Default::default()), &[all, to])
}

/// This rank's block of the mean over the ranks of the gradient `d` of a parameter of `numel`
/// elements: widened to FP32 (FP64 stays), flattened, padded, reduce-scattered (only where
/// `when` is true, when given: else this rank's block of its own).
pub(super) fn scattered(
    b: &mut Builder,
    d: ValueId,
    numel: u64,
    z: StateShard,
    when: Option<ValueId>,
) -> Result<ValueId> {
    let dt = b.dtype(d).map_err(PassError::Usage)?;
    let wide = if matches!(dt, DType::F32 | DType::F64) { dt } else { DType::F32 };
    let mut x = if wide == dt { d } else { b.cast(d, wide) };
    let flat = b.ints(&[-1]);
    x = b.op("flatten", Op::Reshape(Default::default()), &[x, flat]);
    let s = z.block_len(numel);
    let padded = s * z.world as u64;
    if padded != numel {
        let pads = b.ints(&[0, (padded - numel) as i64]);
        x = b.op("pad", Op::Pad(Default::default()), &[x, pads]);
    }
    let attrs = ReduceScatterAttrs { reduction: CollectiveReduction::Mean, world: z.world as i64 };
    let out = b.ops("reduce_scatter", Op::ReduceScatter(Box::new(attrs)), &[Some(x), when], 1)[0];
    // Typed now: the rest of the optimizer pass reads the gradients' dtypes.
    b.g.set_ty(out, TypeInfo::new(wide, mpc_ir::Shape::fixed(&[s])));
    Ok(out)
}

/// Replaces the initializer `v` by this rank's block of it, under the same name, and makes its
/// readers read the gathered whole: the block's value.
pub fn read_gathered(g: &mut Graph, v: ValueId, z: StateShard) -> Result<ValueId> {
    let name = g.name(v).to_string();
    let t =
        g.value(v).initializer().cloned().ok_or_else(|| PassError::Usage(format!("`{name}` is not an initializer")))?;
    g.rename(v, &format!("{name}.unsharded"));
    let mut b = Builder::new(g);
    b.at(&format!("{name}.gather"));
    let block = b.init(&name, z.block(&t));
    let whole = gathered(&mut b, block, t.shape(), z);
    g.set_ty(whole, TypeInfo::new(t.dtype(), mpc_ir::Shape::fixed(t.shape())));
    // The whole is left to dead-code elimination.
    g.replace_uses(v, whole);
    Ok(block)
}

/// Every initializer of `g` named in `sharded` read as its gathered blocks ([`read_gathered`]):
/// a graph that reads the masters (the evaluation graph) made to read a sharded state.
pub fn read_sharded(g: &mut Graph, sharded: &[String], z: StateShard) -> Result<()> {
    for name in sharded {
        if let Some(v) = g.find(name).filter(|&v| g.value(v).initializer().is_some()) {
            read_gathered(g, v, z)?;
            g.remove_value(v);
        }
    }
    Ok(())
}
