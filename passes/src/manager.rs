//! The pass manager: an explicit pipeline, verification after every pass, dump-after, stop-after.

use mpc_ir::{Graph, NodeId};

use crate::{
    infer, train, CastCleanup, Changed, Context, Dce, Effect, ExpandAttention, FuseAttention, GemmTranspose,
    InferTypes, Pass, PassError, Precision, Result, Simplify, UnrollRnn,
};

/// A named list of passes.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    verify: bool,
    dump_after: Vec<String>,
    stop_after: Option<String>,
}

/// The standard pipelines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pipeline {
    /// infer types → simplify → precision → fused attention → cast cleanup → dead-code elimination.
    Inference,
    /// infer types → simplify → add loss → precision → fused attention → train mode → loss scale →
    /// autodiff → optimizer → Gemm transposes → cast cleanup → dead-code elimination.
    Training,
}

impl PassManager {
    pub fn new(passes: Vec<Box<dyn Pass>>) -> PassManager {
        PassManager { passes, verify: true, dump_after: Vec::new(), stop_after: None }
    }

    pub fn pipeline(p: Pipeline) -> PassManager {
        match p {
            Pipeline::Inference => PassManager::new(vec![
                Box::new(InferTypes),
                Box::new(UnrollRnn),
                Box::new(ExpandAttention),
                Box::new(Simplify),
                Box::new(Precision),
                Box::new(FuseAttention),
                Box::new(CastCleanup),
                Box::new(Dce),
            ]),
            Pipeline::Training => PassManager::new(vec![
                Box::new(InferTypes),
                Box::new(UnrollRnn),
                Box::new(ExpandAttention),
                Box::new(Simplify),
                Box::new(train::AddLoss),
                Box::new(Precision),
                Box::new(FuseAttention),
                Box::new(train::TrainMode),
                Box::new(train::LossScalePass),
                Box::new(train::Autodiff),
                Box::new(train::OptimizerPass),
                Box::new(GemmTranspose),
                Box::new(CastCleanup),
                Box::new(Dce),
            ]),
        }
    }

    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    fn check_name(&self, name: &str) -> Result<()> {
        if self.passes.iter().any(|p| p.name() == name) {
            Ok(())
        } else {
            Err(PassError::UnknownPass(name.to_string(), self.pass_names().join(", ")))
        }
    }

    /// Hands a copy of the graph to the caller after the named pass.
    pub fn dump_after(mut self, name: &str) -> Result<Self> {
        self.check_name(name)?;
        self.dump_after.push(name.to_string());
        Ok(self)
    }

    /// Stops the pipeline after the named pass.
    pub fn stop_after(mut self, name: &str) -> Result<Self> {
        self.check_name(name)?;
        self.stop_after = Some(name.to_string());
        Ok(self)
    }

    /// Skips verification (benchmarks of a single pass).
    pub fn without_verify(mut self) -> Self {
        self.verify = false;
        self
    }

    /// Runs the pipeline. `dump` receives `(pass name, graph)` after each pass asked for.
    pub fn run(&self, g: &mut Graph, cx: &Context, dump: &mut dyn FnMut(&str, &Graph)) -> Result<()> {
        for pass in &self.passes {
            let t0 = std::time::Instant::now();
            let effect = pass.effect();
            // The nodes there before a pass that adds some, numbered in order first: the passes
            // that add nodes append them in order, so every later sort stays linear.
            let before: Vec<bool> = if effect == Effect::Adds {
                if let Some(map) = g.sort_nodes()? {
                    if let Some(report) = cx.report.borrow_mut().as_mut() {
                        report.nodes =
                            std::mem::take(&mut report.nodes).into_iter().map(|(n, r)| (map[n.index()], r)).collect();
                    }
                }
                existing_nodes(g)
            } else {
                Vec::new()
            };
            let changed = pass.run(g, cx)?;
            let failed = |msg: String| PassError::Verify { pass: pass.name(), msg };
            if changed == Changed::Yes && effect == Effect::Adds {
                let order = g.check_structure().map_err(|e| failed(e.to_string()))?;
                let added = |n: NodeId| !before.get(n.index()).copied().unwrap_or(false);
                infer::infer_types_in(g, &order, Some(&added))?;
            }
            let t1 = std::time::Instant::now();
            if self.verify && changed == Changed::Yes {
                if effect == Effect::Rewrites || cfg!(debug_assertions) {
                    verify(g).map_err(failed)?;
                } else if effect == Effect::Removes {
                    g.check_structure().map_err(|e| failed(e.to_string()))?;
                }
            }
            cx.timings.borrow_mut().push((pass.name(), t1 - t0, t1.elapsed()));
            if self.dump_after.iter().any(|d| d == pass.name()) {
                dump(pass.name(), g);
            }
            if self.stop_after.as_deref() == Some(pass.name()) {
                break;
            }
        }
        Ok(())
    }
}

/// A flag per node index: whether a node has that index now.
fn existing_nodes(g: &Graph) -> Vec<bool> {
    let mut present = Vec::with_capacity(g.node_count());
    for n in g.node_ids() {
        if present.len() <= n.index() {
            present.resize(n.index() + 1, false);
        }
        present[n.index()] = true;
    }
    present
}

/// Checks a graph: structure (every value read is defined once, no cycle, outputs defined) and
/// types (each node's output dtypes are what its op gives for its input dtypes).
pub fn verify(g: &Graph) -> Result<(), String> {
    let order = g.check_structure().map_err(|e| e.to_string())?;
    infer::check_types(g, &order)
}
