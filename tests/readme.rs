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

#[test]
fn every_op_has_a_checked_gradient_rule_or_is_listed_without_one() {
    let text = readme();
    let list = text
        .split("<!-- nograd:begin -->")
        .nth(1)
        .and_then(|t| t.split("<!-- nograd:end -->").next())
        .expect("no-gradient list markers");
    // The names before each parenthesised reason.
    let mut without: BTreeSet<String> = BTreeSet::new();
    let mut depth = 0;
    let mut word = String::new();
    for ch in list.chars().chain(std::iter::once(' ')) {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            c if depth == 0 && c.is_ascii_alphanumeric() => word.push(c),
            _ if depth == 0 && !word.is_empty() => {
                without.insert(std::mem::take(&mut word));
            }
            _ => {}
        }
    }
    let tests = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/gradients/main.rs"))
        .expect("gradients/main.rs");
    let known: BTreeSet<String> = mpc_ir::Op::KNOWN.iter().map(|s| s.to_string()).collect();
    let unknown: Vec<&String> = without.difference(&known).collect();
    assert!(unknown.is_empty(), "README lists ops without a gradient that are not ops: {unknown:?}");
    // An op a test builds may still be a helper there (a comparison feeding Where): only the ops
    // not listed must each be built by a finite-difference case.
    let untested: Vec<&String> =
        known.iter().filter(|op| !without.contains(*op) && !tests.contains(&format!("\"{op}\""))).collect();
    assert!(
        untested.is_empty(),
        "ops with neither a finite-difference case nor a README line saying why not: {untested:?}"
    );
}
