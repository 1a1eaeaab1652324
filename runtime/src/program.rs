//! Lowering: a typed graph, every shape known, becomes a [`Program`] once; a device then only
//! replays it.
//!
//! [`lower`] walks the schedule and
//! - folds every node whose inputs are all known when lowering (constants, the initializers that
//!   no step changes, and `Shape`/`Size` of statically shaped values) by running it on the CPU
//!   reference: the shape arithmetic of exported models (`Shape → Gather → Concat → Reshape`)
//!   leaves no launch behind;
//! - makes Reshape, Squeeze, Unsqueeze, Flatten and Identity views: the output is the input's
//!   bytes under another shape, no launch;
//! - gives every other node one [`Launch`], a resolved descriptor: the typed op, its operands'
//!   places, dtypes and shapes, and its host operands (shapes, axes, starts/ends, pads, scales:
//!   [`Op::host_operands`]) as values. A launch never reads device data to learn a shape;
//! - lays out memory in three regions: the activation arena by the memory plan's placement (each
//!   buffer at the lowest offset free over its lifetime; an element-wise output over an input that
//!   dies with it; inputs and outputs at fixed places); the state region, laid out by a
//!   [`StateLayout`] that several programs can share (the training step at two batch sizes and
//!   the evaluation forward read the same weights), where each state value keeps one slot and its
//!   next value is copied into it after a step, so no address changes between steps; and the
//!   constants region of the program's own weights and folded values.
//!
//! Two kinds of node become part of their readers' launches instead of launches of their own: a
//! Cast to f32 read only by ops that widen as they load ([`Operand::Widened`]), and a Transpose
//! of the last two axes read only by matrix products ([`Operand::Transposed`]). An element-wise
//! node that is the only reader of an op's first output becomes part of that op's launch where
//! the op can apply it as it writes ([`takes_epilogue`]: a layer norm's Cast to f16, a batch
//! norm's Relu). Runs of element-wise launches become one launch each ([`crate::fuse`]), and a
//! training step's optimizer updates one multi-tensor launch ([`Launch::group`]).
//!
//! An op no backend can run is an error here, naming its node, before any step.

use std::collections::{HashMap, HashSet};

use mpc_ir::{DType, Graph, NodeId, Op, ValueId};

use crate::fuse::Chain;
use crate::value::HostTensor;
use crate::{cpu, RuntimeError};

mod groups;
mod lower;
mod readers;
mod siblings;

/// Which memory region a tensor lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Region {
    /// Activations, inputs and outputs: reused within a step by the memory plan.
    Arena,
    /// Training state and the weights a step may change: kept across steps, shared by the
    /// programs of one session.
    State,
    /// The program's weights and folded values: written once.
    Constants,
}

/// Where a tensor lives and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    pub region: Region,
    pub offset: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        (self.numel() * self.dtype.size()) as u64
    }
}

/// One input of a launch.
#[derive(Clone, Debug)]
pub enum Operand {
    /// An omitted optional input.
    Absent,
    /// A tensor in device memory.
    Device(TensorRef),
    /// A value known when lowering (a shape, axes, a parameter), carried by the descriptor.
    Host(HostTensor),
    /// A tensor in device memory in f16 or bf16 that the launch reads widened to f32: the graph's
    /// Cast to f32 fused into its only reader (see [`reads_widened`]), so the f32 copy is never
    /// written. The results are those of the Cast and the op.
    Widened(TensorRef),
    /// A tensor of rank 2 or more that the launch reads with its last two axes swapped: the
    /// graph's Transpose fused into its reader, a matrix product, which reads the stored matrices
    /// transposed (a GEMM's transpose flag), so the transposed copy is never written. The
    /// reference holds the stored tensor (its shape is the Transpose's input's).
    Transposed(TensorRef),
    /// A tensor that a matrix product reads through a permutation of its axes: the graph's
    /// Transpose fused into its reader ([`reads_through`]: the stored last axis stays one of the
    /// matrix axes), which reads each matrix where it lies, a leading dim and a batch of
    /// addresses. The reference holds the stored tensor; operand axis `i` is its axis `perm[i]`.
    Permuted(TensorRef, Vec<usize>),
}

impl Operand {
    /// The device tensor the launch reads (as stored), if the operand is one.
    pub fn tensor(&self) -> Option<&TensorRef> {
        match self {
            Operand::Device(t) | Operand::Widened(t) | Operand::Transposed(t) | Operand::Permuted(t, _) => Some(t),
            Operand::Absent | Operand::Host(_) => None,
        }
    }
}

/// The operands a launch may read widened from f16 or bf16 ([`Operand::Widened`]): the scores
/// of a SoftmaxCrossEntropyLoss (the loss over a language model's f16 logits, computed in f32,
/// without an f32 copy of the logits), and SoftmaxGrad's dy and y (the gradient of an f32
/// softmax between f16 matrix products, from the f16 gradient and probabilities).
/// And LayerNormalizationGrad's dy (an f32 layer norm's gradient, from the f16 gradient of the
/// matrix product that read its output).
pub fn reads_widened(op: &Op, slot: usize) -> bool {
    matches!(
        (op, slot),
        (Op::SoftmaxCrossEntropyLoss(_), 0) | (Op::SoftmaxGrad(_), 0 | 1) | (Op::LayerNormalizationGrad(_), 0)
    )
}

/// The element-wise ops a launch may apply to its first output as it writes it
/// ([`Launch::epilogue`]), the op's only reader: a Cast of an f32 LayerNormalization's y to f16 or
/// bf16 (an f32 layer norm before f16 matrix products: the launch writes the low values, rounding
/// once where the Cast would have), the Relu after a BatchNormalization (a convolution block's)
/// the Relu after a Gemm (a dense layer's; cuBLASLt's epilogue on CUDA), and a Transpose after
/// a MatMul that keeps one of its matrix axes last ([`writes_permuted`]: attention's heads merged
/// back, the result written in place). The results are those of the op and then the epilogue, to the bit.
pub fn takes_epilogue(op: &Op, then: &Op, from: Option<DType>, to: Option<DType>) -> bool {
    match (op, then) {
        (Op::LayerNormalization(_), Op::Cast(_)) => {
            from == Some(DType::F32) && matches!(to, Some(DType::F16 | DType::BF16))
        }
        (Op::BatchNormalization(_) | Op::Gemm(_), Op::Relu) => from == to,
        (Op::MatMul, Op::Transpose(t)) => from == to && t.perm.as_deref().is_some_and(writes_permuted),
        _ => false,
    }
}

/// The operands a launch may read through a ReLU's gradient ([`Launch::relu_prologue`]): a
/// BatchNormalizationGrad's dy, the gradient of the ReLU after a batch norm (a convolution
/// block's). The launch reads `ReluGrad(dY, Y)` (dY where the ReLU's output Y is positive, 0
/// elsewhere) as it loads dy, to the bit; the ReluGrad's result is never written.
pub fn reads_relu_grad(op: &Op, slot: usize) -> bool {
    matches!((op, slot), (Op::BatchNormalizationGrad(_), 0))
}

/// Whether a matrix product can write its result through the permutation `perm` (a Transpose
/// that reads only the product): the output's last axis must be one of the product's two matrix
/// axes, so that each matrix lands with one of its axes contiguous (the other is its leading
/// dim); the batch axes may go anywhere (each matrix's address is then its own).
pub fn writes_permuted(perm: &[i64]) -> bool {
    permutation(perm).is_some_and(|p| p.len() >= 2 && p[p.len() - 1] + 2 >= p.len())
}

/// A Transpose's `perm` as axes, where it is a permutation of `0..perm.len()`.
pub fn permutation(perm: &[i64]) -> Option<Vec<usize>> {
    let mut seen = vec![false; perm.len()];
    perm.iter()
        .map(|&a| {
            let a = usize::try_from(a).ok().filter(|&a| a < perm.len())?;
            (!std::mem::replace(&mut seen[a], true)).then_some(a)
        })
        .collect()
}

/// Whether a matrix product can add a bias as it writes its result (an Add epilogue with a second
/// operand, [`Launch::epilogue_operand`]): a MatMul of a stored (not transposed) operand of rank 2
/// or more by a weight matrix (a Linear over a sequence, exported as MatMul then Add), the bias
/// one value per output feature (`[n]`, or `[1, .., n]`), all of one dtype. Rows of A against one
/// matrix are one product, whose bias is cuBLASLt's epilogue on CUDA.
pub fn adds_bias(a: &[usize], b: &[usize], y: &[usize], bias: &[usize]) -> bool {
    let n = y.last().copied();
    a.len() >= 2
        && b.len() == 2
        && b.last().copied() == n
        && !bias.is_empty()
        && bias.last().copied() == n
        && bias[..bias.len() - 1].iter().all(|&d| d == 1)
}

/// Whether a launch of `op` can add a residual as it writes its result (an Add epilogue whose
/// second operand, [`Launch::epilogue_operand`], is of the result's dtype and shape, and the
/// Relu after it, [`Launch::epilogue_then`]): a BatchNormalization's, the last of a residual
/// block before the Add of its shortcut (ResNet's). Each rounds as the unfused launches do: the
/// results are the Add's and the Relu's, to the bit.
pub fn adds_residual(op: &Op) -> bool {
    matches!(op, Op::BatchNormalization(_))
}

/// The bytes of a ReLU mask ([`Launch::relu_mask`]) of a `[rows, cols]` result: one bit per
/// element, each row's bits (`cols` of them, the column-major matrix's leading dim as a library
/// sees the row-major result) padded to a multiple of 128, as cuBLASLt's bit-masks need.
pub fn relu_mask_bytes(rows: usize, cols: usize) -> u64 {
    relu_mask_shape(rows, cols).iter().product::<usize>() as u64
}

/// A ReLU mask's place as bytes: `rows` rows of `cols` bits padded to 128 ([`relu_mask_bytes`]).
pub fn relu_mask_shape(rows: usize, cols: usize) -> Vec<usize> {
    vec![rows, cols.next_multiple_of(128) / 8]
}

/// Whether `op`'s epilogue is computed by a matrix-product library (cuBLASLt's ReLU after a Gemm,
/// a MatMul's result written through a Transpose by arrays of addresses), which may choose
/// another algorithm for the fused product than for the plain one: the same arithmetic, summed
/// in another order (and a bias added before the result's one rounding, not after); an
/// activation's gradient applied to the unrounded product, a GELU's by the library's own
/// formula for its slope.
pub fn library_epilogue(op: &Op) -> bool {
    matches!(op, Op::Gemm(_) | Op::MatMul)
}

/// Whether a matrix product can read an operand through the permutation `perm` of its stored
/// axes ([`Operand::Permuted`]): the stored last axis must stay one of the matrix axes (each
/// matrix then has one contiguous axis, the other is its leading dim).
pub fn reads_through(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2 && (perm[r - 1] == r - 1 || perm[r - 2] == r - 1)
}

/// Whether a launch of `op` can read its operand `slot` through the permutation `perm` of the
/// stored axes ([`Operand::Permuted`]): a matrix product's two where the stored last axis stays
/// one of the matrix axes ([`reads_through`]), and a fused attention's Q, K and V (and its
/// gradient's dY, Q, K, V and Y) where it stays last: each row contiguous, the rows and heads at
/// their strides (the heads split from `[B, S, H, D]`).
pub fn reads_permuted(op: &Op, slot: usize, perm: &[usize]) -> bool {
    // D stays last, and the batch axes before the heads (all but the last three) stay in place,
    // so that one stride walks them.
    let r = perm.len();
    let keeps_last = r >= 3 && perm[r - 1] == r - 1 && perm[..r - 3].iter().enumerate().all(|(i, &a)| a == i);
    match op {
        Op::MatMul => slot < 2 && reads_through(perm),
        Op::Attention(_) => slot < 3 && keeps_last,
        Op::AttentionGrad(_) => slot < 5 && keeps_last,
        _ => false,
    }
}

/// The operands a launch may read transposed ([`Operand::Transposed`]): both of a MatMul's.
pub fn reads_transposed(op: &Op, slot: usize) -> bool {
    matches!((op, slot), (Op::MatMul, 0 | 1))
}

/// One kernel launch, fully resolved.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The node it comes from, for messages (`"name" (Op)`).
    pub node: String,
    pub op: Op,
    pub inputs: Vec<Operand>,
    pub outputs: Vec<TensorRef>,
    /// An `If`: both branches, lowered into the same regions; the step reads the condition.
    pub branches: Option<Box<IfLaunch>>,
    /// Element-wise steps fused into this launch (its `op` is then only a marker, the opaque
    /// `ai.mpc.runtime::Fused`, which no device runs as an op).
    pub chain: Option<Box<Chain>>,
    /// An element-wise op applied to output 0 as it is written ([`takes_epilogue`]): output 0 is
    /// that op's result (its place has the op's dtype, and the op's shape where the op read a
    /// reshape of the product: a GELU's gradient over a sequence), not the launch op's.
    pub epilogue: Option<Op>,
    /// The epilogue's second operand, where it has two (a bias the product adds, [`adds_bias`]; a
    /// residual block's shortcut, [`adds_residual`]; the ReLU's output or the GELU's input whose
    /// gradient a product applies); the launch's result is the epilogue op's first operand (an
    /// Add's either: it commutes).
    pub epilogue_operand: Option<Operand>,
    /// An element-wise op of one operand applied after the epilogue, to its result (the Relu
    /// after a residual block's Add, [`adds_residual`]): output 0 is then this op's result.
    pub epilogue_then: Option<Op>,
    /// A multi-tensor launch: these launches, optimizer updates of one op and attribute set that
    /// read nothing another of them writes, run as one kernel (their order does not matter). The
    /// launch's `op` is theirs; its own inputs and outputs are empty.
    pub group: Vec<Launch>,
    /// A launch computed in the same call, reading what this one reads: a Gemm's bias gradient
    /// (the column sums of the `dY` its weight gradient reads; cuBLASLt's bias-gradient
    /// epilogue on CUDA). A device may also run it as a launch of its own, after this one.
    pub sibling: Option<Box<Launch>>,
    /// A dense layer's ReLU signs as bits ([`relu_mask_bytes`]): written by the launch of a Gemm
    /// with a Relu epilogue, read by a later product's launch with that ReLU's ReluGrad epilogue
    /// (the backward pass's next input gradient), both given the same place. A device whose
    /// matrix-product library keeps them (cuBLASLt's `RELU_AUX` and `DRELU` epilogues on CUDA)
    /// reads the bits instead of the ReluGrad's operand (the ReLU's output, 8 or 16 times the
    /// bytes); any other device, or a product the library refuses, computes the ReluGrad from
    /// that operand as if there were no mask. Nothing else reads the bits.
    pub relu_mask: Option<TensorRef>,
    /// The ReLU output `Y` through whose gradient the launch reads input 0 ([`reads_relu_grad`]):
    /// input 0 holds the ReluGrad's dY, and the launch's op reads `ReluGrad(dY, Y)` in its
    /// place.
    pub relu_prologue: Option<Operand>,
    /// The outputs (by index) that nothing reads and the program does not return, which a device
    /// may leave unwritten: a first convolution's input gradient, the gradient of an input that
    /// takes none (ConvGrad's outputs are positional, dX before dW).
    pub unread: Vec<usize>,
}

impl Launch {
    /// A launch of `op` alone: no branches, chain, epilogue, group or sibling.
    pub fn new(node: impl Into<String>, op: Op, inputs: Vec<Operand>, outputs: Vec<TensorRef>) -> Launch {
        Launch {
            node: node.into(),
            op,
            inputs,
            outputs,
            branches: None,
            chain: None,
            epilogue: None,
            epilogue_operand: None,
            epilogue_then: None,
            group: Vec::new(),
            sibling: None,
            relu_mask: None,
            relu_prologue: None,
            unread: Vec::new(),
        }
    }

    /// The op type, `Fused(Cast+Mul+Add)` for a chain, or `Multi(AdamUpdate)` for a group: what a
    /// profile groups launches by.
    pub fn kind(&self) -> String {
        if !self.group.is_empty() {
            return format!("Multi({})", self.op.op_type());
        }
        let own = self.chain.as_ref().map_or_else(|| self.op.op_type().to_string(), |c| c.kind());
        match &self.sibling {
            Some(s) => format!("{own}+{}", s.kind()),
            None => own,
        }
    }

    /// Every operand the launch itself reads: its inputs, its epilogue's second operand and the
    /// ReLU output of its prologue.
    pub fn operands(&self) -> impl Iterator<Item = &Operand> {
        self.inputs.iter().chain(&self.epilogue_operand).chain(&self.relu_prologue)
    }

    /// The launch itself, or the members of a group.
    pub fn members(&self) -> &[Launch] {
        if self.group.is_empty() {
            std::slice::from_ref(self)
        } else {
            &self.group
        }
    }

    /// Every launch this one computes: itself or a group's members, and its sibling.
    pub fn parts(&self) -> Vec<&Launch> {
        self.members().iter().chain(self.sibling.as_deref()).collect()
    }
}

/// Whether the lowering groups optimizer updates into multi-tensor launches: the ops whose
/// updates may share one kernel.
pub fn groups(op: &Op) -> bool {
    matches!(op, Op::AdamUpdate(_))
}

/// The two branches of an `If`, each a list of launches over the program's regions (their
/// buffers past the program's own, their constants in its constants region), and where each
/// leaves its results; the taken branch's results are copied into the launch's outputs.
#[derive(Clone, Debug)]
pub struct IfLaunch {
    pub cond: TensorRef,
    pub then_launches: Vec<Launch>,
    pub then_outputs: Vec<TensorRef>,
    pub else_launches: Vec<Launch>,
    pub else_outputs: Vec<TensorRef>,
}

/// The branches of an `If` node, decoded and typed (the caller decodes them: lowering does not
/// read ONNX), and the branches of the `If` nodes inside them.
#[derive(Clone, Debug)]
pub struct Branches {
    pub then_graph: Graph,
    pub else_graph: Graph,
    pub then_nested: HashMap<NodeId, Branches>,
    pub else_nested: HashMap<NodeId, Branches>,
}

/// What lowering needs besides the graph.
#[derive(Clone, Copy, Debug, Default)]
pub struct LowerOptions<'a> {
    /// The state layout to share (a program over another's state); `None`: lay it out here.
    pub layout: Option<&'a StateLayout>,
    /// Initializers that may change between runs besides the training state (an evaluation
    /// graph's weights): not folded, kept in the state region.
    pub variables: Option<&'a HashSet<ValueId>>,
    /// The decoded branches of the graph's `If` nodes.
    pub branches: Option<&'a HashMap<NodeId, Branches>>,
    /// Launch every element-wise node on its own ([`crate::fuse`] off; so does `MPC_FUSE=0`).
    pub unfused: bool,
    /// Only the fusions that compute the unfused program's bits on every device: element-wise
    /// chains, the norms' epilogues and multi-tensor updates; not the products that a library
    /// computes with an algorithm of its choosing for the fused form ([`library_epilogue`], and
    /// bias gradients beside their weight gradients).
    pub bitwise: bool,
}

/// A training state value: its slot, and where the step leaves its next value.
#[derive(Clone, Debug)]
pub struct StateSlot {
    pub name: String,
    pub slot: TensorRef,
    pub next: TensorRef,
}

/// The places of the state values, by name: one layout for every program of a session.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateLayout {
    pub values: Vec<(String, TensorRef)>,
    pub bytes: u64,
}

impl StateLayout {
    pub fn find(&self, name: &str) -> Option<&TensorRef> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
}

/// What a device must provide for lowering.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCaps {
    pub name: &'static str,
    /// Alignment of every buffer, in bytes.
    pub align: u64,
    /// The most bytes a program may hold on the device (arena, state and constants together):
    /// a program over it is refused when lowering, before anything is allocated.
    pub memory: u64,
    /// Chains of element-wise ops are lowered as one launch ([`crate::fuse`]).
    pub fuse: bool,
}

/// A lowered graph: the launches of one step over a fixed memory layout.
#[derive(Clone, Debug)]
pub struct Program {
    pub align: u64,
    pub arena_bytes: u64,
    pub constants_bytes: u64,
    pub inputs: Vec<(String, TensorRef)>,
    pub outputs: Vec<(String, TensorRef)>,
    pub launches: Vec<Launch>,
    /// The constants region's contents: the graph's own tensors where they are initializers
    /// (their bytes shared), else the values lowering folded.
    pub constants: Vec<(TensorRef, mpc_ir::Tensor)>,
    /// The state region's layout, and the initial values the graph gives its state: the graph's
    /// own tensors (their bytes shared, not copied: a model's weights and zero moments are most
    /// of the host memory a training compile takes).
    pub state_layout: StateLayout,
    pub state_init: Vec<(TensorRef, mpc_ir::Tensor)>,
    /// The state the step advances: each next value is copied into its slot after the step.
    pub state: Vec<StateSlot>,
    /// Host reads a step makes to choose `If` branches.
    pub host_reads: usize,
    /// Nodes computed when lowering.
    pub folded: usize,
    /// Nodes that became views.
    pub views: usize,
    /// Casts fused into their reader ([`Operand::Widened`]).
    pub widened: usize,
    /// Element-wise nodes applied by the launch that makes their input ([`Launch::epilogue`],
    /// [`Launch::epilogue_then`]).
    pub epilogues: usize,
    /// ReluGrads read by the launch of their reader ([`Launch::relu_prologue`]).
    pub prologues: usize,
    /// Launches computed by another launch's call ([`Launch::sibling`]).
    pub siblings: usize,
    /// Transposes fused into their matrix-product readers ([`Operand::Transposed`]).
    pub transposed: usize,
    /// Optimizer updates grouped into multi-tensor launches ([`Launch::group`]), and the groups.
    pub grouped: (usize, usize),
    /// Element-wise launches fused into chains ([`Launch::chain`]), and the chains.
    pub fused: (usize, usize),
    /// The arena's buffers, for reports of what its peak holds.
    pub buffers: Vec<ArenaBuffer>,
}

/// One buffer of the arena: its place and size, the launch steps it lives over (from the launch
/// that writes it, or 0 for a graph input, to the last that reads it), and the values it holds in
/// turn (an element-wise output taking over an input's buffer), each with the step that writes it.
#[derive(Clone, Debug)]
pub struct ArenaBuffer {
    pub offset: u64,
    pub bytes: u64,
    pub first: usize,
    pub last: usize,
    pub values: Vec<(usize, String, DType, Vec<usize>)>,
}

impl Program {
    /// The value of the constant at `place`, as a host tensor (what a plan reads of it).
    pub fn constant(&self, place: &TensorRef) -> Option<HostTensor> {
        self.constants.iter().find(|(p, _)| p == place).map(|(_, v)| HostTensor::from(v))
    }

    /// The place of a graph output, input or state value named `name`.
    pub fn find(&self, name: &str) -> Option<&TensorRef> {
        self.outputs
            .iter()
            .chain(&self.inputs)
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .or_else(|| self.state_layout.find(name))
    }
}

/// What is known of an input of a node computed when lowering: its value, or (for `Shape` and
/// `Size`, which read nothing else) its dtype and shape.
#[derive(Clone, Copy, Debug)]
pub enum Known<'a> {
    Value(&'a HostTensor),
    Shape(DType, &'a [usize]),
}

/// Computes a node whose inputs are known, on the CPU reference: what lowering folds, and what
/// a caller folds into a graph before inferring its shapes. An input known only by its shape
/// reaches the kernel as an empty tensor of that shape (all `Shape` reads).
pub fn fold(op: &Op, ins: &[Option<Known>], n_outputs: usize) -> Result<Vec<HostTensor>, cpu::KernelError> {
    fold_within(op, ins, n_outputs, crate::device::DeviceOptions::default().memory())
}

/// [`fold`], an output whose shape comes from data refused past `limit` bytes (a device's memory).
pub fn fold_within(
    op: &Op,
    ins: &[Option<Known>],
    n_outputs: usize,
    limit: u64,
) -> Result<Vec<HostTensor>, cpu::KernelError> {
    for k in ins.iter().flatten() {
        let (d, s) = match k {
            Known::Value(t) => (t.dtype(), &t.shape[..]),
            Known::Shape(d, s) => (*d, *s),
        };
        if !addressable(d, s) {
            return Err(cpu::KernelError::Invalid(format!(
                "an input of {d}{s:?} has dims that multiply past the {MAX_TENSOR_BYTES} bytes mpc addresses"
            )));
        }
    }
    if let (Op::Size, Some(Some(x))) = (op, ins.first()) {
        let numel = match x {
            Known::Value(t) => t.len(),
            Known::Shape(_, s) => s.iter().product(),
        };
        return Ok(vec![HostTensor::from_i64(DType::I64, vec![], vec![numel as i64])]);
    }
    let placeholders: Vec<Option<HostTensor>> = ins
        .iter()
        .map(|k| match k {
            Some(Known::Shape(d, s)) => Some(HostTensor::from_f64(*d, s.to_vec(), Vec::new())),
            _ => None,
        })
        .collect();
    let refs: Vec<Option<&HostTensor>> = ins
        .iter()
        .zip(&placeholders)
        .map(|(k, p)| match k {
            Some(Known::Value(t)) => Some(*t),
            _ => p.as_ref(),
        })
        .collect();
    cpu::run_op_within(op, &refs, n_outputs, limit)
}

/// The largest tensor lowering accepts (2^48 bytes: more than any device's memory, small enough
/// that every offset and size computed from it fits in 64 bits).
pub const MAX_TENSOR_BYTES: u64 = 1 << 48;

/// Whether a tensor of `dims` is within what mpc addresses: its bytes and, when it is empty, the
/// bytes its other dims would take. Kernels multiply any of a tensor's dims (a batch, an inner
/// size), so an empty one's must not multiply past 64 bits either.
pub(crate) fn addressable(dtype: DType, dims: &[usize]) -> bool {
    dims.iter()
        .filter(|&&d| d != 0)
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
        .is_some_and(|b| b <= MAX_TENSOR_BYTES)
}

/// Lowers `g`, whose every value has a known dtype and shape (bind the symbolic dims and infer
/// first), for a device with `caps`. The options' variables are initializers that may change
/// between runs besides the training state (an evaluation graph's weights): they are not folded,
/// and live in the state region. With a layout, they take the places it gives them by name (a
/// program that shares another's state); without, the program lays its state out itself.
pub fn lower(g: &Graph, caps: DeviceCaps, opts: LowerOptions) -> Result<Program, RuntimeError> {
    lower::lower_in(g, caps, opts, None)
}

pub(crate) fn kernel_error(g: &Graph, n: NodeId, e: cpu::KernelError) -> RuntimeError {
    match e {
        cpu::KernelError::Invalid(msg) => RuntimeError::Node { node: g.node_label(n), msg },
        cpu::KernelError::Unsupported(msg) => RuntimeError::Unsupported { node: g.node_label(n), msg },
    }
}
