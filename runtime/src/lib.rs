//! mpc-runtime: lowering (schedule + memory plan) and the backends that execute a graph.
//!
//! [`Backend`] is what a device implements: buffers it owns, uploads and downloads, and one call
//! per node. [`Cpu`] is the reference: every op on host memory, FP16/BF16 stored as half with f32
//! arithmetic and accumulation (the GPU conventions), deterministic. [`run`] checks the inputs
//! against the graph, executes in schedule order and frees each value after its last reader.

pub mod cpu;
pub mod device;
pub mod plan;
pub mod program;
pub mod session;
pub mod value;

use std::collections::HashMap;

use mpc_ir::{Dim, Graph, Op, ValueId};

pub use cpu::KernelError;
pub use plan::{plan, Plan};
pub use value::{Data, HostTensor};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("input `{0}` is missing")]
    MissingInput(String),
    #[error("`{0}` is not an input of the model (inputs: {1})")]
    UnexpectedInput(String, String),
    #[error("input `{name}` is {got}, the model expects {expected}")]
    WrongDtype { name: String, expected: String, got: String },
    #[error("input `{name}` has shape {got:?}, the model expects {expected}")]
    WrongShape { name: String, expected: String, got: Vec<usize> },
    #[error("node {node}: {msg}")]
    Unsupported { node: String, msg: String },
    #[error("node {node}: {msg}")]
    Node { node: String, msg: String },
    #[error("the size of `{0}` is unknown: bind its symbolic dims first")]
    UnknownShape(String),
    #[error("{0}")]
    Graph(String),
    /// An invariant of mpc itself failed.
    #[error("internal error: {0}")]
    Internal(String),
}

/// A device that executes ops on buffers it owns.
pub trait Backend {
    type Buffer;
    fn name(&self) -> &'static str;
    fn upload(&self, t: &HostTensor) -> Result<Self::Buffer, RuntimeError>;
    fn download(&self, b: &Self::Buffer) -> Result<HostTensor, RuntimeError>;
    /// Runs one op; `n_outputs` is the number of outputs the node declares.
    fn execute(
        &self,
        op: &Op,
        inputs: &[Option<&Self::Buffer>],
        n_outputs: usize,
    ) -> Result<Vec<Self::Buffer>, KernelError>;
}

/// The CPU reference backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Backend for Cpu {
    type Buffer = HostTensor;
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn upload(&self, t: &HostTensor) -> Result<HostTensor, RuntimeError> {
        Ok(t.clone())
    }
    fn download(&self, b: &HostTensor) -> Result<HostTensor, RuntimeError> {
        Ok(b.clone())
    }
    fn execute(
        &self,
        op: &Op,
        inputs: &[Option<&HostTensor>],
        n_outputs: usize,
    ) -> Result<Vec<HostTensor>, KernelError> {
        cpu::run_op(op, inputs, n_outputs)
    }
}

fn check_input(g: &Graph, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
    let name = g.name(v).to_string();
    let ty = g.ty(v);
    if let Some(d) = ty.dtype {
        if d != t.dtype() {
            return Err(RuntimeError::WrongDtype { name, expected: d.to_string(), got: t.dtype().to_string() });
        }
    }
    if let Some(shape) = &ty.shape {
        let fits = shape.rank() == t.shape.len()
            && shape.dims().iter().zip(&t.shape).all(|(d, &n)| !matches!(d, Dim::Fixed(f) if *f as usize != n));
        if !fits {
            return Err(RuntimeError::WrongShape { name, expected: shape.to_string(), got: t.shape.clone() });
        }
    }
    Ok(())
}

/// A graph ready to run on a backend: schedule computed and weights uploaded once. If nodes (kept
/// opaque by the compiler) run here: their branches are decoded into graphs of their own, whose
/// extra inputs are the outer values the branch reads, and the taken branch runs as a sub-session.
pub struct Session<'g, B: Backend + Clone> {
    backend: B,
    g: &'g Graph,
    order: Vec<mpc_ir::NodeId>,
    last_use: HashMap<ValueId, usize>,
    weights: HashMap<ValueId, B::Buffer>,
    branches: HashMap<mpc_ir::NodeId, [Graph; 2]>,
}

/// The then/else graphs of an `If` node.
fn if_branches(g: &Graph, n: mpc_ir::NodeId) -> Result<Option<[Graph; 2]>, RuntimeError> {
    let node = g.node(n);
    let Op::Opaque(o) = &node.op else { return Ok(None) };
    if !(o.domain.is_empty() && o.op_type == "If") {
        return Ok(None);
    }
    let captures: Vec<ValueId> = node.inputs()[o.explicit_inputs..].iter().flatten().copied().collect();
    let branch = |name: &str| -> Result<Graph, RuntimeError> {
        let raw = o.attrs.iter().find_map(|(k, a)| match a {
            mpc_ir::Attr::Raw(b) if k == name => Some(b),
            _ => None,
        });
        let raw = raw.ok_or_else(|| RuntimeError::Graph(format!("node {}: no `{name}`", g.node_label(n))))?;
        mpc_ir::onnx::decode_subgraph(raw, g, &captures)
            .map_err(|e| RuntimeError::Graph(format!("node {}: {name}: {e}", g.node_label(n))))
    };
    Ok(Some([branch("then_branch")?, branch("else_branch")?]))
}

impl<'g, B: Backend + Clone> Session<'g, B> {
    pub fn new(backend: B, g: &'g Graph) -> Result<Self, RuntimeError> {
        let order = g.topo_order().map_err(|e| RuntimeError::Graph(e.to_string()))?;
        let mut last_use: HashMap<ValueId, usize> = HashMap::new();
        for (step, &n) in order.iter().enumerate() {
            for v in g.node(n).inputs().iter().flatten() {
                last_use.insert(*v, step);
            }
        }
        let mut weights = HashMap::new();
        for v in g.initializers() {
            if let Some(t) = g.value(v).initializer() {
                weights.insert(v, backend.upload(&HostTensor::from(t))?);
            }
        }
        let mut branches = HashMap::new();
        for &n in &order {
            if let Some(b) = if_branches(g, n)? {
                branches.insert(n, b);
            }
        }
        Ok(Session { backend, g, order, last_use, weights, branches })
    }

    /// Runs an `If`: evaluates the condition and runs the branch it picks.
    fn run_if(&self, n: mpc_ir::NodeId, env: &HashMap<ValueId, B::Buffer>) -> Result<Vec<B::Buffer>, RuntimeError> {
        let g = self.g;
        let node = g.node(n);
        let fetch = |v: ValueId| -> Result<HostTensor, RuntimeError> {
            let b = env.get(&v).or_else(|| self.weights.get(&v));
            self.backend.download(b.ok_or_else(|| RuntimeError::Graph(format!("`{}` was not computed", g.name(v))))?)
        };
        let cond = fetch(node.input(0).ok_or_else(|| RuntimeError::Graph("If without a condition".into()))?)?;
        let taken = cond.f64s().first().is_some_and(|&c| c != 0.0);
        let branch = &self.branches[&n][if taken { 0 } else { 1 }];
        let Op::Opaque(o) = &node.op else { unreachable!("branches exist only for If nodes") };
        let mut feeds = HashMap::new();
        for v in node.inputs()[o.explicit_inputs..].iter().flatten() {
            feeds.insert(g.name(*v).to_string(), fetch(*v)?);
        }
        let outs = Session::new(self.backend.clone(), branch)?.run(&feeds)?;
        outs.iter().map(|(_, t)| self.backend.upload(t)).collect()
    }

    /// Runs once with named inputs; returns the graph outputs by name, in order.
    pub fn run(&self, inputs: &HashMap<String, HostTensor>) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
        let env = self.execute(inputs)?;
        let g = self.g;
        g.outputs()
            .iter()
            .map(|&v| {
                let b = env.get(&v).or_else(|| self.weights.get(&v));
                let b = b.ok_or_else(|| RuntimeError::Graph(format!("output `{}` was not computed", g.name(v))))?;
                Ok((g.name(v).to_string(), self.backend.download(b)?))
            })
            .collect()
    }

    /// One training step: runs once, then each state value takes its next value (moved, not
    /// copied: the state stays resident on the backend). Returns the values named in `fetch`.
    pub fn step(
        &mut self,
        inputs: &HashMap<String, HostTensor>,
        state: &[(ValueId, ValueId)],
        fetch: &[ValueId],
    ) -> Result<Vec<HostTensor>, RuntimeError> {
        let mut env = self.execute(inputs)?;
        let g = self.g;
        let fetched = fetch
            .iter()
            .map(|v| {
                let b = env.get(v).or_else(|| self.weights.get(v));
                self.backend
                    .download(b.ok_or_else(|| RuntimeError::Graph(format!("`{}` was not computed", g.name(*v))))?)
            })
            .collect::<Result<Vec<_>, _>>()?;
        for &(s, next) in state {
            let b =
                env.remove(&next).ok_or_else(|| RuntimeError::Graph(format!("`{}` was not computed", g.name(next))))?;
            self.weights.insert(s, b);
        }
        Ok(fetched)
    }

    /// The current value of an initializer (for state: after the last step).
    pub fn weight(&self, v: ValueId) -> Result<Option<HostTensor>, RuntimeError> {
        self.weights.get(&v).map(|b| self.backend.download(b)).transpose()
    }

    /// Replaces an initializer's value (a checkpoint's state, trained weights).
    pub fn set_weight(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
        let want = self
            .g
            .value(v)
            .initializer()
            .map(|i| (i.dtype(), i.shape().iter().map(|&d| d as usize).collect::<Vec<_>>()));
        if let Some((dt, shape)) = want {
            if dt != t.dtype() || shape != t.shape {
                return Err(RuntimeError::WrongShape {
                    name: self.g.name(v).to_string(),
                    expected: format!("{dt}{shape:?}"),
                    got: t.shape.clone(),
                });
            }
        }
        self.weights.insert(v, self.backend.upload(t)?);
        Ok(())
    }

    /// Runs the schedule; the environment keeps the graph outputs.
    fn execute(&self, inputs: &HashMap<String, HostTensor>) -> Result<HashMap<ValueId, B::Buffer>, RuntimeError> {
        let g = self.g;
        for name in inputs.keys() {
            if !g.inputs().iter().any(|&v| g.name(v) == name) {
                let all: Vec<&str> = g.inputs().iter().map(|&v| g.name(v)).collect();
                return Err(RuntimeError::UnexpectedInput(name.clone(), all.join(", ")));
            }
        }
        let mut env: HashMap<ValueId, B::Buffer> = HashMap::new();
        for &v in g.inputs() {
            let t = inputs.get(g.name(v)).ok_or_else(|| RuntimeError::MissingInput(g.name(v).to_string()))?;
            check_input(g, v, t)?;
            env.insert(v, self.backend.upload(t)?);
        }
        for (step, &n) in self.order.iter().enumerate() {
            let node = g.node(n);
            let outs = if self.branches.contains_key(&n) {
                self.run_if(n, &env)?
            } else {
                let get = |v: ValueId| env.get(&v).or_else(|| self.weights.get(&v));
                let ins: Vec<Option<&B::Buffer>> = node.inputs().iter().map(|i| i.and_then(get)).collect();
                self.backend.execute(&node.op, &ins, node.outputs().len()).map_err(|e| match e {
                    KernelError::Invalid(msg) => RuntimeError::Node { node: g.node_label(n), msg },
                    KernelError::Unsupported(msg) => RuntimeError::Unsupported { node: g.node_label(n), msg },
                })?
            };
            for (&o, t) in node.outputs().iter().zip(outs) {
                env.insert(o, t);
            }
            for v in node.inputs().iter().flatten() {
                if !g.is_output(*v) && self.last_use.get(v) == Some(&step) {
                    env.remove(v);
                }
            }
        }
        Ok(env)
    }
}

/// Runs `g` once on `backend` (see [`Session`] to run repeatedly).
pub fn run<B: Backend + Clone>(
    backend: &B,
    g: &Graph,
    inputs: &HashMap<String, HostTensor>,
) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
    Session::new(backend.clone(), g)?.run(inputs)
}
