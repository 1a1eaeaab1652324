//! Dead-code elimination: removes nodes and initializers that no graph output depends on.

use mpc_ir::{Def, Graph};

use crate::{Changed, Context, Effect, Pass, Result};

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn effect(&self) -> Effect {
        Effect::Removes
    }

    fn run(&self, g: &mut Graph, _cx: &Context) -> Result<Changed> {
        // Mark backwards from the outputs.
        let mut live_values = vec![false; g.value_ids().count()];
        let mut stack: Vec<_> = g.outputs().to_vec();
        let mut live_nodes = vec![false; g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0)];
        while let Some(v) = stack.pop() {
            if std::mem::replace(&mut live_values[v.index()], true) {
                continue;
            }
            if let Some((n, _)) = g.value(v).producer() {
                if !std::mem::replace(&mut live_nodes[n.index()], true) {
                    stack.extend(g.node(n).inputs().iter().flatten().copied());
                }
            }
        }
        let dead: Vec<_> = g.node_ids().filter(|n| !live_nodes[n.index()]).collect();
        let mut changed = !dead.is_empty();
        g.remove_nodes(&dead);
        let unused: Vec<_> = g.initializers().filter(|&v| g.value(v).uses().is_empty() && !g.is_output(v)).collect();
        changed |= !unused.is_empty();
        for v in unused {
            debug_assert!(matches!(g.value(v).def(), Def::Init(_)));
            g.remove_value(v);
        }
        Ok(if changed { Changed::Yes } else { Changed::No })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpc_ir::{DType, Op, Shape, Tensor, TypeInfo};

    #[test]
    fn removes_what_no_output_reads() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", TypeInfo::new(DType::F32, Shape::fixed(&[2])));
        let w = g.add_initializer("unused", Tensor::from_f32(vec![1], &[1.0]));
        let (_, a) = g.add_op("a", Op::Relu, &[Some(x)], 1);
        let (_, dead) = g.add_op("dead", Op::Neg, &[Some(x)], 1);
        let (_, _dead2) = g.add_op("dead2", Op::Exp, &[Some(dead[0])], 1);
        g.add_output(a[0]);
        assert_eq!(Dce.run(&mut g, &Context::default()).unwrap(), Changed::Yes);
        assert_eq!(g.node_count(), 1);
        assert!(g.value(w).initializer().is_none());
        assert_eq!(Dce.run(&mut g, &Context::default()).unwrap(), Changed::No);
    }
}
