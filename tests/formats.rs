//! External tensor data on import, and the .dot / .json outputs.

mod common;

use common::{fixture, mpc, scratch};
use mpc_ir::onnx::proto::{tensor_proto, ModelProto, StringStringEntryProto};
use prost::Message;

/// The MLP with `fc2.weight` moved to `weights.bin` at `offset`, with `location` as written.
fn external_mlp(dir: &std::path::Path, location: &str) -> (std::path::PathBuf, Vec<u8>) {
    let mut m = ModelProto::decode(std::fs::read(fixture("mlp")).unwrap().as_slice()).unwrap();
    let t = m.graph.as_mut().unwrap().initializer.iter_mut().find(|t| t.name == "fc2.weight").unwrap();
    let data = t.raw_data.to_vec();
    let mut file = vec![7u8; 128];
    file.extend_from_slice(&data);
    std::fs::write(dir.join("weights.bin"), &file).unwrap();
    t.raw_data = Default::default();
    t.data_location = tensor_proto::EXTERNAL;
    let kv = |k: &str, v: &str| StringStringEntryProto { key: k.into(), value: v.into() };
    t.external_data = vec![kv("location", location), kv("offset", "128"), kv("length", &data.len().to_string())];
    let path = dir.join("external.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    (path, data)
}

#[test]
fn external_data_is_read_next_to_the_model() {
    let dir = scratch("external_data");
    let (path, data) = external_mlp(&dir, "weights.bin");
    let g = mpc::load(&path).unwrap();
    let w = g.find("fc2.weight").and_then(|v| g.value(v).initializer().cloned()).unwrap();
    assert_eq!(w.bytes().as_ref(), data.as_slice());
    // Export writes the data inline: the output stands alone.
    let out = dir.join("inline.onnx");
    let r = mpc(&["compile", path.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let direct = dir.join("direct.onnx");
    assert!(mpc(&["compile", fixture("mlp").to_str().unwrap(), "-o", direct.to_str().unwrap()]).status.success());
    assert!(std::fs::read(out).unwrap() == std::fs::read(direct).unwrap());
}

/// Every initializer of the MLP in one external file is read with the file once: the tensors
/// share its bytes (a model's weights in one file, hundreds of tensors, used to cost the file's
/// size once per tensor: a 650 MB GPT took more than 24 GB to load).
#[test]
fn tensors_in_one_external_file_share_its_bytes() {
    let dir = scratch("external_shared");
    let mut m = ModelProto::decode(std::fs::read(fixture("mlp")).unwrap().as_slice()).unwrap();
    let mut file = Vec::new();
    let mut offsets = Vec::new();
    let kv = |k: &str, v: &str| StringStringEntryProto { key: k.into(), value: v.into() };
    for t in m.graph.as_mut().unwrap().initializer.iter_mut() {
        let data = t.raw_data.to_vec();
        offsets.push((t.name.clone(), file.len(), data.clone()));
        let at = file.len().to_string();
        file.extend_from_slice(&data);
        t.raw_data = Default::default();
        t.data_location = tensor_proto::EXTERNAL;
        t.external_data = vec![kv("location", "all.bin"), kv("offset", &at), kv("length", &data.len().to_string())];
    }
    assert!(offsets.len() >= 4);
    std::fs::write(dir.join("all.bin"), &file).unwrap();
    let path = dir.join("shared.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    let g = mpc::load(&path).unwrap();
    let first = g.find(&offsets[0].0).and_then(|v| g.value(v).initializer().cloned()).unwrap();
    for (name, offset, data) in &offsets {
        let t = g.find(name).and_then(|v| g.value(v).initializer().cloned()).unwrap();
        assert_eq!(t.bytes().as_ref(), data.as_slice(), "{name}");
        // One buffer: each tensor lies at its offset from the first one's bytes.
        assert_eq!(t.bytes().as_ptr() as usize - first.bytes().as_ptr() as usize, offset - offsets[0].1, "{name}");
    }
}

/// A tensor of an If branch in an external file is read from the model's folder, whatever the
/// working folder, and an output written elsewhere carries its data.
#[test]
fn external_data_inside_a_branch_is_read_next_to_the_model() {
    use mpc_ir::onnx::proto::{AttributeProto, GraphProto, TensorProto};
    let dir = scratch("external_branch");
    let mut m = ModelProto::decode(std::fs::read(fixture("control_flow")).unwrap().as_slice()).unwrap();
    let node = m.graph.as_mut().unwrap().node.iter_mut().find(|n| n.op_type == "If").unwrap();
    let a: &mut AttributeProto = node.attribute.iter_mut().find(|a| a.name == "then_branch").unwrap();
    let mut body = GraphProto::decode(a.g.clone().unwrap()).unwrap();
    // The branch multiplies by its own `bscale` (3.0, stored at offset 4 of branch.bin).
    body.node[0].input[1] = "bscale".into();
    let kv = |k: &str, v: &str| StringStringEntryProto { key: k.into(), value: v.into() };
    body.initializer.push(TensorProto {
        name: "bscale".into(),
        dims: vec![1],
        data_type: 1,
        data_location: tensor_proto::EXTERNAL,
        external_data: vec![kv("location", "branch.bin"), kv("offset", "4"), kv("length", "4")],
        ..Default::default()
    });
    a.g = Some(body.encode_to_vec().into());
    let mut file = vec![0u8; 4];
    file.extend_from_slice(&3.0f32.to_le_bytes());
    std::fs::write(dir.join("branch.bin"), &file).unwrap();
    let path = dir.join("branch.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    // The tests run in the repository's folder, not the model's.
    assert_ne!(std::env::current_dir().unwrap(), dir);
    mpc::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let out_dir = scratch("external_branch_out");
    let out = out_dir.join("out.onnx");
    let r = mpc(&["compile", path.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let written = ModelProto::decode(std::fs::read(&out).unwrap().as_slice()).unwrap();
    let node = written.graph.as_ref().unwrap().node.iter().find(|n| n.op_type == "If").unwrap();
    let body = GraphProto::decode(node.attribute.iter().find(|a| a.name == "then_branch").unwrap().g.clone().unwrap());
    let t = body.unwrap().initializer.into_iter().find(|t| t.name == "bscale").unwrap();
    assert_eq!((t.data_location, t.raw_data.as_ref()), (0, 3.0f32.to_le_bytes().as_slice()));
    let r = mpc(&["run", out.to_str().unwrap(), "--random-inputs", "1", "--dim", "batch=2"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

#[test]
fn external_data_may_not_leave_the_model_folder() {
    let dir = scratch("external_escape");
    let (path, _) = external_mlp(&dir, "../weights.bin");
    let e = mpc::load(&path).unwrap_err().to_string();
    assert!(e.contains("leaves the model's folder"), "{e}");
}

#[test]
fn external_data_may_not_leave_the_model_folder_through_a_link() {
    let dir = scratch("external_link");
    let outside = scratch("external_link_outside");
    let (path, _) = external_mlp(&dir, "link.bin");
    std::fs::rename(dir.join("weights.bin"), outside.join("weights.bin")).unwrap();
    std::os::unix::fs::symlink(outside.join("weights.bin"), dir.join("link.bin")).unwrap();
    let r = mpc(&["compile", path.to_str().unwrap(), "-o", dir.join("out.onnx").to_str().unwrap()]);
    let e = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{e}");
    assert!(
        e.contains("`link.bin` leaves the model's folder (through a link)") && e.trim().lines().count() == 1,
        "{e}"
    );
    assert!(!dir.join("out.onnx").exists());
    // A link that stays inside the folder is followed.
    std::fs::rename(outside.join("weights.bin"), dir.join("weights.bin")).unwrap();
    std::fs::remove_file(dir.join("link.bin")).unwrap();
    std::os::unix::fs::symlink("weights.bin", dir.join("link.bin")).unwrap();
    assert!(mpc::load(&path).is_ok());
}

#[test]
fn dot_and_json_outputs() {
    let dir = scratch("dot_json");
    let src = fixture("transformer");
    let (dot, json) = (dir.join("t.dot"), dir.join("t.json"));
    for out in [&dot, &json] {
        let r = mpc(&["compile", src.to_str().unwrap(), "-o", out.to_str().unwrap()]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    }
    let dot = std::fs::read_to_string(dot).unwrap();
    assert!(dot.starts_with("digraph \"transformer\""));
    assert_eq!(dot.matches("[label=\"Softmax\\n").count(), 1);
    assert_eq!(dot.matches("[label=\"MatMul\\n").count(), 8);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    // 36 nodes as exported, less four: the erf GELU (Div, Erf, Add, Mul, Mul) is one Gelu.
    assert_eq!(v["nodes"].as_array().unwrap().len(), 32);
    assert_eq!(v["inputs"][0]["shape"], serde_json::json!(["batch", 8]));
    let softmax = v["nodes"].as_array().unwrap().iter().find(|n| n["op_type"] == "Softmax").unwrap();
    assert_eq!(softmax["outputs"][0]["shape"], serde_json::json!(["batch", 4, 8, 8]));
}

#[test]
fn dot_is_coloured_by_precision() {
    let r = mpc(&["inspect", fixture("transformer").to_str().unwrap(), "--policy", "mixed", "--dot"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let dot = String::from_utf8_lossy(&r.stdout);
    let lines = |op: &str| {
        dot.lines().filter(|l| l.contains(&format!("[label=\"{op}\\n"))).map(str::to_string).collect::<Vec<_>>()
    };
    assert!(lines("MatMul").iter().all(|l| l.contains("#9ecae1")), "MatMuls are f16-blue");
    assert!(lines("Softmax").iter().all(|l| l.contains("#fdd0a2")), "Softmax is f32-orange");
    assert_eq!(lines("Cast").len(), 6);
}
