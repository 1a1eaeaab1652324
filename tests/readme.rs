//! The README's claims that code can check.

use std::collections::BTreeSet;

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md")
}

#[test]
fn op_table_lists_exactly_the_closed_op_set() {
    let text = readme();
    let table = text
        .split("<!-- ops:begin -->")
        .nth(1)
        .and_then(|t| t.split("<!-- ops:end -->").next())
        .expect("op table markers");
    let listed: BTreeSet<&str> = table
        .lines()
        .flat_map(|l| l.split('|'))
        .map(str::trim)
        .filter(|c| !c.is_empty() && !c.starts_with('-'))
        .collect();
    let known: BTreeSet<&str> = mpc_ir::Op::KNOWN.iter().copied().collect();
    assert_eq!(listed, known, "README op table and Op::KNOWN differ");
}

#[test]
fn text_ir_example_is_what_mpc_writes() {
    let text = readme();
    let example = text.split("```\nmpcir 1").nth(1).and_then(|t| t.split("```").next()).expect("text IR example");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/models/mlp.onnx");
    let mut g = mpc::load(path.as_ref()).unwrap();
    mpc::compile(&mut g, path.as_ref(), &mpc::Options::default(), &mut |_, _| {}).unwrap();
    let printed = mpc_ir::text::print(&g, mpc_ir::text::TensorMode::FILE).unwrap().text;
    assert_eq!(format!("mpcir 1{example}"), printed);
}

#[test]
fn precision_table_is_the_code_table() {
    let text = readme();
    let table = text
        .split("<!-- precision:begin -->\n")
        .nth(1)
        .and_then(|t| t.split("<!-- precision:end -->").next())
        .expect("precision table markers");
    let expected = mpc::explain::precision_table();
    assert!(table == expected, "README precision table is stale; replace it with:\n{expected}");
}
