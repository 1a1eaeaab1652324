//! The graph: nodes (ops) and values (tensors), behind typed ids.
//!
//! Nodes live in a petgraph `StableGraph` (stable indices that survive removals, behind typed ids);
//! values live in a side table with their definition and their uses. The edges are explicit ports:
//! a node's input slots name values, and each value lists its uses `(node, slot)`. petgraph's own
//! edge lists are not used: unlinking an edge there walks the node's list, which made rewiring the
//! inputs of a node with many of them quadratic (measured on a 100k-input Sum). All mutation goes
//! through this API, which keeps inputs and uses in step; petgraph's indices never leak.

use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::NodeIndexable;
use serde::{Deserialize, Serialize};

use crate::{DType, Op, Shape, Tensor};

/// A node in a [`Graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(u32);

/// A value (tensor) in a [`Graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(u32);

impl NodeId {
    fn ix(self) -> NodeIndex {
        NodeIndex::new(self.0 as usize)
    }
    pub fn index(self) -> usize {
        self.0 as usize
    }
    /// The id whose [`NodeId::index`] is `i` (for tables indexed by node).
    pub fn from_index(i: usize) -> NodeId {
        NodeId(i as u32)
    }
}

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Dtype and shape of a value, each possibly unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TypeInfo {
    pub dtype: Option<DType>,
    pub shape: Option<Shape>,
}

impl TypeInfo {
    pub fn new(dtype: DType, shape: Shape) -> TypeInfo {
        TypeInfo { dtype: Some(dtype), shape: Some(shape) }
    }
}

impl fmt::Display for TypeInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype {
            Some(d) => write!(f, "{d}")?,
            None => f.write_str("?")?,
        }
        match &self.shape {
            Some(s) => write!(f, "{s}"),
            None => Ok(()),
        }
    }
}

/// Where a value comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum Def {
    /// Declared but not (yet) defined: an error once the graph is built.
    None,
    /// A graph input.
    Input,
    /// An initializer: a tensor with data (boxed: most values are not initializers).
    Init(Box<Tensor>),
    /// Output `slot` of a node.
    Node(NodeId, usize),
}

/// A use of a value: input `slot` of `node`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Use {
    pub node: NodeId,
    pub slot: usize,
}

/// A value: its name (unique in the graph), its type and its definition.
#[derive(Clone, Debug)]
pub struct Value {
    /// Shared with the graph's name index, so a value's name is allocated once.
    pub name: Arc<str>,
    pub ty: TypeInfo,
    def: Def,
    uses: SmallVec<[Use; 1]>,
    /// Set when a second definition was attempted (import reports it as an error).
    redefined: bool,
}

impl Value {
    pub fn def(&self) -> &Def {
        &self.def
    }
    pub fn uses(&self) -> &[Use] {
        &self.uses
    }
    pub fn producer(&self) -> Option<(NodeId, usize)> {
        match self.def {
            Def::Node(n, s) => Some((n, s)),
            _ => None,
        }
    }
    pub fn initializer(&self) -> Option<&Tensor> {
        match &self.def {
            Def::Init(t) => Some(t),
            _ => None,
        }
    }
}

/// An operation node.
#[derive(Clone, Debug)]
pub struct Node {
    /// The node's name (may be empty, as in ONNX).
    pub name: String,
    pub op: Op,
    inputs: SmallVec<[Option<ValueId>; 2]>,
    outputs: SmallVec<[ValueId; 2]>,
}

impl Node {
    /// Inputs by slot; `None` for an omitted optional input.
    pub fn inputs(&self) -> &[Option<ValueId>] {
        &self.inputs
    }
    pub fn input(&self, slot: usize) -> Option<ValueId> {
        self.inputs.get(slot).copied().flatten()
    }
    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }
}

/// Model-level information carried from import to export.
#[derive(Clone, Debug, Default)]
pub struct ModelMeta {
    pub ir_version: i64,
    pub producer_name: String,
    pub producer_version: String,
    pub domain: String,
    pub model_version: i64,
    pub doc_string: String,
    /// Opset imports by domain ("" is ai.onnx).
    pub opsets: Vec<(String, i64)>,
    pub metadata_props: Vec<(String, String)>,
    /// The main graph's own metadata (the torch dynamo exporter writes its program's signature,
    /// which names the parameters and buffers, here). Read, not written back.
    pub graph_metadata_props: Vec<(String, String)>,
    /// Model-local functions, encoded `FunctionProto`s kept as they came.
    pub functions: Vec<bytes::Bytes>,
}

impl ModelMeta {
    /// The ai.onnx opset version, 0 when the model imports none.
    pub fn onnx_opset(&self) -> i64 {
        self.opsets.iter().find(|(d, _)| d.is_empty() || d == "ai.onnx").map_or(0, |(_, v)| *v)
    }

    pub fn set_opset(&mut self, domain: &str, version: i64) {
        match self.opsets.iter_mut().find(|(d, _)| d == domain || (domain.is_empty() && d == "ai.onnx")) {
            Some(e) => e.1 = version,
            None => self.opsets.push((domain.to_string(), version)),
        }
    }
}

/// Structural errors that the graph itself detects.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    #[error("the graph has a cycle through node {0}")]
    Cycle(String),
    #[error("node {node} reads `{value}`, which nothing defines")]
    Undefined { node: String, value: String },
    #[error("value `{0}` is defined more than once")]
    Redefined(String),
    #[error("graph output `{0}` is not defined")]
    UndefinedOutput(String),
    #[error("graph output `{0}` is listed more than once")]
    OutputTwice(String),
}

/// A computation graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    pub meta: ModelMeta,
    /// Node storage only: the edges are the ports (inputs and uses).
    nodes: StableDiGraph<Node, ()>,
    values: Vec<Value>,
    by_name: HashMap<Arc<str>, ValueId, foldhash::fast::FixedState>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
    /// The training contract, on graphs the training passes built.
    pub train: Option<crate::TrainSignature>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Graph::default() }
    }

    /// Makes room for `nodes` more nodes and `values` more values, so that a pass that grows the
    /// graph several times over (autodiff) does not copy it at every doubling.
    pub fn reserve(&mut self, nodes: usize, values: usize) {
        self.nodes.reserve_nodes(nodes);
        self.values.reserve(values);
        self.by_name.reserve(values);
    }

    // ---- values ----

    /// A new value with no definition yet. Its name is made unique if it is taken; an empty
    /// name makes an anonymous value (an omitted optional output, or a temporary).
    pub fn new_value(&mut self, name: &str, ty: TypeInfo) -> ValueId {
        let name: Arc<str> = if name.is_empty() { Arc::from("") } else { self.claim(name) };
        self.push_value(name, ty)
    }

    fn push_value(&mut self, name: Arc<str>, ty: TypeInfo) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        if !name.is_empty() {
            self.by_name.insert(name.clone(), id);
        }
        self.values.push(Value { name, ty, def: Def::None, uses: SmallVec::new(), redefined: false });
        id
    }

    /// `name` if no value has it, else `name.1`, `name.2`, ...
    pub fn unique_name(&self, name: &str) -> String {
        self.claim(name).to_string()
    }

    /// [`Graph::unique_name`], allocated once as the shared form a value keeps.
    fn claim(&self, name: &str) -> Arc<str> {
        let base = if name.is_empty() { "v" } else { name };
        if !name.is_empty() && !self.by_name.contains_key(base) {
            return Arc::from(base);
        }
        let free = (1..).map(|i| format!("{base}.{i}")).find(|n| !self.by_name.contains_key(n.as_str()));
        Arc::from(free.unwrap_or_default())
    }

    pub fn add_input(&mut self, name: &str, ty: TypeInfo) -> ValueId {
        let v = self.new_value(name, ty);
        self.values[v.index()].def = Def::Input;
        self.inputs.push(v);
        v
    }

    pub fn add_initializer(&mut self, name: &str, tensor: Tensor) -> ValueId {
        let ty = TypeInfo::new(tensor.dtype(), Shape::fixed(tensor.shape()));
        let v = self.new_value(name, ty);
        self.values[v.index()].def = Def::Init(Box::new(tensor));
        v
    }

    /// Turns a declared value into an initializer (or replaces an initializer's data).
    pub fn set_initializer(&mut self, v: ValueId, tensor: Tensor) {
        let val = &mut self.values[v.index()];
        val.ty = TypeInfo::new(tensor.dtype(), Shape::fixed(tensor.shape()));
        if !matches!(val.def, Def::None | Def::Init(_)) {
            val.redefined = true;
        }
        val.def = Def::Init(Box::new(tensor));
    }

    pub fn value(&self, v: ValueId) -> &Value {
        &self.values[v.index()]
    }

    pub fn ty(&self, v: ValueId) -> &TypeInfo {
        &self.values[v.index()].ty
    }

    pub fn set_ty(&mut self, v: ValueId, ty: TypeInfo) {
        self.values[v.index()].ty = ty;
    }

    pub fn name(&self, v: ValueId) -> &str {
        &self.values[v.index()].name
    }

    /// Renames a value; the new name is made unique if taken. Returns the name given.
    pub fn rename(&mut self, v: ValueId, name: &str) -> String {
        let old = std::mem::replace(&mut self.values[v.index()].name, Arc::from(""));
        if self.by_name.get(&old) == Some(&v) {
            self.by_name.remove(&old);
        }
        let name: Arc<str> = if name.is_empty() { Arc::from("") } else { self.claim(name) };
        if !name.is_empty() {
            self.by_name.insert(name.clone(), v);
        }
        self.values[v.index()].name = name.clone();
        name.to_string()
    }

    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.by_name.get(name).copied()
    }

    /// The value's data, when it is an initializer or the output of a `Constant` node.
    pub fn constant(&self, v: ValueId) -> Option<&Tensor> {
        match &self.values[v.index()].def {
            Def::Init(t) => Some(t),
            Def::Node(n, 0) => match &self.node(*n).op {
                Op::Constant(c) => Some(&c.value),
                _ => None,
            },
            _ => None,
        }
    }

    /// Every value ever created (including dead ones), by id.
    pub fn value_ids(&self) -> impl Iterator<Item = ValueId> + '_ {
        (0..self.values.len() as u32).map(ValueId)
    }

    /// How many values were ever created: one past the largest value id (ids are never reused).
    pub fn value_bound(&self) -> usize {
        self.values.len()
    }

    /// Initializers in creation order.
    pub fn initializers(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|&v| matches!(self.values[v.index()].def, Def::Init(_)))
    }

    /// Drops an initializer or input that nothing uses any more.
    pub fn remove_value(&mut self, v: ValueId) {
        let val = &mut self.values[v.index()];
        debug_assert!(val.uses.is_empty(), "removing a used value");
        if matches!(val.def, Def::Input) {
            self.inputs.retain(|&i| i != v);
        }
        val.def = Def::None;
        self.outputs.retain(|&o| o != v);
        let name = std::mem::replace(&mut self.values[v.index()].name, Arc::from(""));
        self.by_name.remove(&name);
    }

    // ---- graph inputs/outputs ----

    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }
    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }
    pub fn add_output(&mut self, v: ValueId) {
        self.outputs.push(v);
    }
    /// [`Graph::add_output`] for readers: an output listed twice is an error.
    pub fn add_new_output(&mut self, v: ValueId) -> Result<(), GraphError> {
        if self.is_output(v) {
            return Err(GraphError::OutputTwice(self.name(v).to_string()));
        }
        self.outputs.push(v);
        Ok(())
    }
    pub fn set_outputs(&mut self, outs: Vec<ValueId>) {
        self.outputs = outs;
    }
    pub fn is_output(&self, v: ValueId) -> bool {
        self.outputs.contains(&v)
    }

    /// Whether something refers to `v` by name: a graph output, or an outer-scope read of an
    /// opaque op's subgraph. Such a value must keep its name (and dtype).
    pub fn name_is_referenced(&self, v: ValueId) -> bool {
        self.is_output(v) || self.values[v.index()].uses.iter().any(|u| self.is_capture(u.node, u.slot))
    }

    /// Whether input `slot` of `n` is an outer-scope read of a subgraph, not an explicit input.
    pub fn is_capture(&self, n: NodeId, slot: usize) -> bool {
        matches!(&self.node(n).op, Op::Opaque(o) if slot >= o.explicit_inputs)
    }

    // ---- nodes ----

    /// Adds a node that defines `outputs` (values made with [`Graph::new_value`]).
    pub fn add_node(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: Vec<Option<ValueId>>,
        outputs: Vec<ValueId>,
    ) -> NodeId {
        self.link(Node { name: name.into(), op, inputs: SmallVec::new(), outputs: SmallVec::from_vec(outputs) }, inputs)
    }

    /// Inserts `node` (its input list empty), defines its outputs and connects `inputs`.
    fn link(&mut self, mut node: Node, inputs: impl IntoIterator<Item = Option<ValueId>>) -> NodeId {
        let inputs = inputs.into_iter();
        node.inputs.reserve_exact(inputs.size_hint().0);
        let id = NodeId(self.nodes.add_node(node).index() as u32);
        for slot in 0..self.nodes[id.ix()].outputs.len() {
            let o = self.nodes[id.ix()].outputs[slot];
            let val = &mut self.values[o.index()];
            if !matches!(val.def, Def::None) {
                val.redefined = true;
            }
            val.def = Def::Node(id, slot);
        }
        for (slot, v) in inputs.enumerate() {
            self.nodes[id.ix()].inputs.push(None);
            self.set_input(id, slot, v);
        }
        id
    }

    /// Adds a node with fresh output values named `{name}` (one output) or `{name}.{i}`.
    pub fn add_op(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[Option<ValueId>],
        n_outputs: usize,
    ) -> (NodeId, Vec<ValueId>) {
        let outs: Vec<ValueId> = (0..n_outputs)
            .map(|i| match n_outputs {
                1 => self.new_value(name, TypeInfo::default()),
                _ => self.new_value(&format!("{name}.{i}"), TypeInfo::default()),
            })
            .collect();
        (self.add_node(name, op, inputs.to_vec(), outs.clone()), outs)
    }

    /// [`Graph::add_op`] for passes that add many nodes: `name` is made unique first (node and
    /// values then share it), and is moved into the node rather than copied.
    pub fn push_op(
        &mut self,
        name: String,
        op: Op,
        inputs: impl IntoIterator<Item = Option<ValueId>>,
        n_outputs: usize,
    ) -> NodeId {
        let name = if self.by_name.contains_key(name.as_str()) { self.claim(&name).to_string() } else { name };
        let mut outputs = SmallVec::with_capacity(n_outputs);
        for i in 0..n_outputs {
            let v = match n_outputs {
                1 => self.push_value(Arc::from(name.as_str()), TypeInfo::default()),
                _ => self.new_value(&format!("{name}.{i}"), TypeInfo::default()),
            };
            outputs.push(v);
        }
        self.link(Node { name, op, inputs: SmallVec::new(), outputs }, inputs)
    }

    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.ix()]
    }

    /// The node's op and name may change freely; its inputs change through [`Graph::set_input`].
    pub fn node_op_mut(&mut self, n: NodeId) -> &mut Op {
        &mut self.nodes[n.ix()].op
    }

    pub fn node_count(&self) -> usize {
        self.nodes.node_count()
    }

    /// Node ids in creation order (not necessarily topological).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.node_indices().map(|i| NodeId(i.index() as u32))
    }

    /// Points input `slot` of `node` at `v` (or at nothing).
    pub fn set_input(&mut self, node: NodeId, slot: usize, v: Option<ValueId>) {
        let ix = node.ix();
        if self.nodes[ix].inputs.len() <= slot {
            self.nodes[ix].inputs.resize(slot + 1, None);
        }
        if let Some(old) = self.nodes[ix].inputs[slot] {
            self.values[old.index()].uses.retain(|u| !(u.node == node && u.slot == slot));
        }
        self.nodes[ix].inputs[slot] = v;
        if let Some(v) = v {
            self.values[v.index()].uses.push(Use { node, slot });
        }
    }

    /// Gives `node` one more output, `v` (a value made with [`Graph::new_value`]): an optional
    /// output the node did not produce before.
    pub fn push_output(&mut self, node: NodeId, v: ValueId) {
        let slot = self.nodes[node.ix()].outputs.len();
        self.nodes[node.ix()].outputs.push(v);
        let val = &mut self.values[v.index()];
        if !matches!(val.def, Def::None) {
            val.redefined = true;
        }
        val.def = Def::Node(node, slot);
    }

    /// Drops the inputs of `node` from slot `len` on (an op that takes fewer inputs now).
    pub fn truncate_inputs(&mut self, node: NodeId, len: usize) {
        for slot in len..self.nodes[node.ix()].inputs.len() {
            self.set_input(node, slot, None);
        }
        self.nodes[node.ix()].inputs.truncate(len);
    }

    /// Makes every reader of `old` (and the graph outputs) read `new` instead.
    pub fn replace_uses(&mut self, old: ValueId, new: ValueId) {
        let uses = self.values[old.index()].uses.to_vec();
        self.move_uses(old, new, &uses);
        for o in &mut self.outputs {
            if *o == old {
                *o = new;
            }
        }
        if let Some(t) = &mut self.train {
            t.replace(old, new);
        }
    }

    /// Makes the given readers of `old` read `new` instead. One pass over `old`'s uses however
    /// many move, so redirecting all readers of a widely read value stays linear.
    pub fn move_uses(&mut self, old: ValueId, new: ValueId, uses: &[Use]) {
        if uses.is_empty() || old == new {
            return;
        }
        if uses.len() <= 8 {
            self.values[old.index()].uses.retain(|u| !uses.contains(u));
        } else {
            let moving: std::collections::HashSet<Use> = uses.iter().copied().collect();
            self.values[old.index()].uses.retain(|u| !moving.contains(u));
        }
        for &u in uses {
            let ix = u.node.ix();
            debug_assert_eq!(self.nodes[ix].inputs[u.slot], Some(old));
            self.nodes[ix].inputs[u.slot] = Some(new);
            self.values[new.index()].uses.push(u);
        }
    }

    /// Removes a node; its outputs must be unused. They become undefined and nameless.
    pub fn remove_node(&mut self, n: NodeId) {
        self.remove_nodes(&[n]);
    }

    /// Removes nodes whose outputs nothing else reads, touching each input's use list once.
    pub fn remove_nodes(&mut self, dead: &[NodeId]) {
        let set: std::collections::HashSet<NodeId> = dead.iter().copied().collect();
        let mut inputs: Vec<ValueId> =
            dead.iter().flat_map(|&n| self.nodes[n.ix()].inputs.iter().flatten().copied()).collect();
        inputs.sort_unstable();
        inputs.dedup();
        for v in inputs {
            self.values[v.index()].uses.retain(|u| !set.contains(&u.node));
        }
        for &n in dead {
            if let Some(node) = self.nodes.remove_node(n.ix()) {
                for o in node.outputs {
                    debug_assert!(
                        self.values[o.index()].uses.iter().all(|u| set.contains(&u.node)),
                        "removing a node whose output is used"
                    );
                    self.values[o.index()].def = Def::None;
                    let name = std::mem::replace(&mut self.values[o.index()].name, Arc::from(""));
                    self.by_name.remove(&name);
                }
            }
        }
    }

    /// Nodes in a deterministic topological order: among ready nodes the oldest goes first, so
    /// a graph that was already sorted keeps its order. A cycle is an error naming a node on it.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, GraphError> {
        // Most graphs are built in order: then index order is the answer (every ready node's
        // producers have smaller indices, so the oldest ready node is always the next index).
        if self.in_index_order() {
            return Ok(self.node_ids().collect());
        }
        self.sorted_order()
    }

    /// [`Graph::topo_order`] of a graph not in index order. A cursor walks the node indices in
    /// order and takes each node that is ready when it gets there; only a node that becomes ready
    /// after the cursor has passed it waits in a heap, so a graph mostly in order sorts in
    /// near-linear time.
    fn sorted_order(&self) -> Result<Vec<NodeId>, GraphError> {
        const DONE: u32 = u32::MAX;
        let bound = self.nodes.node_bound();
        // Unready inputs per node; DONE for emitted nodes and vacant indices.
        let mut indeg = vec![DONE; bound];
        for ix in self.nodes.node_indices() {
            indeg[ix.index()] = 0;
        }
        // Counted from the values' side: one sequential walk instead of a lookup per input.
        for val in &self.values {
            if matches!(val.def, Def::Node(..)) {
                for u in &val.uses {
                    indeg[u.node.index()] += 1;
                }
            }
        }
        let mut late = BinaryHeap::new();
        let mut cursor = 0;
        let mut order = Vec::with_capacity(self.nodes.node_count());
        loop {
            while cursor < bound && indeg[cursor] != 0 {
                cursor += 1;
            }
            let i = match late.peek() {
                Some(&std::cmp::Reverse(h)) if h < cursor => {
                    late.pop();
                    h
                }
                _ if cursor < bound => cursor,
                _ => break,
            };
            indeg[i] = DONE;
            order.push(NodeId(i as u32));
            for &o in &self.nodes[NodeIndex::new(i)].outputs {
                for u in &self.values[o.index()].uses {
                    let t = u.node.index();
                    indeg[t] -= 1;
                    if indeg[t] == 0 && t < cursor {
                        late.push(std::cmp::Reverse(t));
                    }
                }
            }
        }
        if order.len() < self.nodes.node_count() {
            let stuck = (0..bound).find(|&i| indeg[i] != DONE && indeg[i] > 0).unwrap_or(0);
            return Err(GraphError::Cycle(self.node_label(NodeId(stuck as u32))));
        }
        Ok(order)
    }

    /// Whether every node's producers have smaller indices than the node.
    fn in_index_order(&self) -> bool {
        self.nodes.node_indices().all(|ix| {
            self.nodes[ix].inputs.iter().flatten().all(|v| match self.values[v.index()].def {
                Def::Node(p, _) => p.index() < ix.index(),
                _ => true,
            })
        })
    }

    /// Renumbers the nodes in [`Graph::topo_order`], without gaps, so that the later sorts are a
    /// linear check and nodes added afterwards stay in order (a removed node's index is taken by
    /// the next node added, so gaps are closed too: a node added later must never land among the
    /// older ones). Node ids held by the caller become stale: the returned table maps each old
    /// index to its new id (`None` when the graph was already in order without gaps and nothing
    /// moved).
    pub fn sort_nodes(&mut self) -> Result<Option<Vec<NodeId>>, GraphError> {
        let in_order = self.in_index_order();
        if in_order && self.nodes.node_bound() == self.nodes.node_count() {
            return Ok(None);
        }
        let order = if in_order { self.node_ids().collect() } else { self.sorted_order()? };
        let mut map = vec![NodeId(u32::MAX); self.nodes.node_bound()];
        let mut nodes = StableDiGraph::with_capacity(order.len(), 0);
        for &old in &order {
            let node = self.nodes.remove_node(old.ix()).expect("the order lists existing nodes");
            map[old.index()] = NodeId(nodes.add_node(node).index() as u32);
        }
        self.nodes = nodes;
        for val in &mut self.values {
            if let Def::Node(n, slot) = val.def {
                val.def = Def::Node(map[n.index()], slot);
            }
            for u in &mut val.uses {
                u.node = map[u.node.index()];
            }
        }
        Ok(Some(map))
    }

    /// `"name" (Op)` for messages.
    pub fn node_label(&self, n: NodeId) -> String {
        let node = self.node(n);
        if node.name.is_empty() {
            format!("#{} ({})", n.0, node.op.op_type())
        } else {
            format!("`{}` ({})", node.name, node.op.op_type())
        }
    }

    /// Structural checks: every value read is defined exactly once, outputs are defined, no
    /// cycle. Returns the topological order.
    pub fn check_structure(&self) -> Result<Vec<NodeId>, GraphError> {
        for v in &self.values {
            if v.redefined {
                return Err(GraphError::Redefined(v.name.to_string()));
            }
        }
        for n in self.node_ids() {
            for v in self.node(n).inputs.iter().flatten() {
                if matches!(self.values[v.index()].def, Def::None) {
                    return Err(GraphError::Undefined {
                        node: self.node_label(n),
                        value: self.values[v.index()].name.to_string(),
                    });
                }
            }
        }
        for &o in &self.outputs {
            if matches!(self.values[o.index()].def, Def::None) {
                return Err(GraphError::UndefinedOutput(self.values[o.index()].name.to_string()));
            }
        }
        self.topo_order()
    }
}

#[cfg(test)]
mod tests;
