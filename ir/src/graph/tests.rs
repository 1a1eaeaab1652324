//! The graph's own invariants: edits keep uses and definitions consistent, and order and
//! validation find what they must.

use super::*;

fn chain() -> (Graph, ValueId, NodeId, NodeId) {
    let mut g = Graph::new("g");
    let x = g.add_input("x", TypeInfo::new(DType::F32, Shape::fixed(&[2])));
    let (a, ao) = g.add_op("a", Op::Relu, &[Some(x)], 1);
    let (b, _) = g.add_op("b", Op::Neg, &[Some(ao[0])], 1);
    (g, x, a, b)
}

#[test]
fn topo_order_and_uses() {
    let (g, x, a, b) = chain();
    assert_eq!(g.topo_order().unwrap(), vec![a, b]);
    assert_eq!(g.value(x).uses(), &[Use { node: a, slot: 0 }]);
}

/// `late` reads the output `bv` of `b`, which was added after it: index order is not
/// topological.
fn out_of_order() -> (Graph, ValueId, ValueId, NodeId, ValueId) {
    let mut g = Graph::new("g");
    let x = g.add_input("x", TypeInfo::new(DType::F32, Shape::fixed(&[2])));
    let bv = g.new_value("b", TypeInfo::default());
    let (late, lo) = g.add_op("late", Op::Relu, &[Some(bv)], 1);
    (g, x, bv, late, lo[0])
}

#[test]
fn topo_order_of_a_graph_built_out_of_order() {
    // Among ready nodes the oldest goes first.
    let (mut g, x, bv, late, _) = out_of_order();
    let (a, _) = g.add_op("a", Op::Neg, &[Some(x)], 1);
    let b = g.add_node("b", Op::Exp, vec![Some(x)], vec![bv]);
    let (c, _) = g.add_op("c", Op::Abs, &[Some(x)], 1);
    assert_eq!(g.topo_order().unwrap(), vec![a, b, late, c]);
    // Built in order, the order is the index order.
    let (g, _, a, b) = chain();
    assert_eq!(g.topo_order().unwrap(), vec![a, b]);
}

#[test]
fn sorting_renumbers_in_topological_order() {
    let (mut g, x, bv, late, lo) = out_of_order();
    g.add_node("b", Op::Exp, vec![Some(x)], vec![bv]);
    g.add_output(lo);
    let map = g.sort_nodes().unwrap().unwrap();
    let order = g.check_structure().unwrap();
    assert_eq!(order.iter().map(|&n| g.node(n).name.as_str()).collect::<Vec<_>>(), ["b", "late"]);
    assert_eq!(map[late.index()], order[1]);
    assert_eq!(g.value(bv).uses(), &[Use { node: order[1], slot: 0 }]);
    assert_eq!(g.value(lo).producer(), Some((order[1], 0)));
    assert!(g.sort_nodes().unwrap().is_none(), "sorted graphs stay as they are");
}

#[test]
fn cycle_is_reported() {
    let (mut g, _, a, b) = chain();
    let bo = g.node(b).outputs()[0];
    g.set_input(a, 0, Some(bo));
    let err = g.topo_order().unwrap_err();
    assert!(matches!(err, GraphError::Cycle(_)), "{err}");
}

#[test]
fn remove_and_rewire() {
    let (mut g, x, a, b) = chain();
    g.set_input(b, 0, Some(x));
    g.remove_node(a);
    assert_eq!(g.node_count(), 1);
    assert_eq!(g.check_structure().unwrap(), vec![b]);
    assert_eq!(g.value(x).uses(), &[Use { node: b, slot: 0 }]);
}

#[test]
fn names_stay_unique() {
    let (mut g, ..) = chain();
    let v = g.new_value("a", TypeInfo::default());
    assert_eq!(g.name(v), "a.1");
}
