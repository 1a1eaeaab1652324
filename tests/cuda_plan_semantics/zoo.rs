//! The zoo's exports, inference and one training step each, planned and checked launch by launch
//! against the CPU.

use super::*;

/// A zoo export whose family is another's as initialised (`gpt2_fresh` beside `gpt2`), exported
/// with a dynamic sequence (`gpt2_seq`) or a fixed batch (`gpt2_fixed`): the same layers and so the
/// same launches, which the emulation need not run twice.
fn same_plans_as_another(zoo: &std::path::Path, export: &std::path::Path) -> bool {
    let stem = export.file_name().unwrap().to_string_lossy();
    let (family, exporter) = stem.split_once('.').unwrap();
    ["_fresh", "_seq", "_fixed"]
        .iter()
        .any(|suffix| family.strip_suffix(suffix).is_some_and(|base| zoo.join(format!("{base}.{exporter}")).exists()))
}

/// The zoo's exports (BERT, DistilBERT, GPT-2, Llama, ViT, MobileNetV3, a UNet, a GroupNorm CNN,
/// an LSTM and a GRU, and GPT-NeoX and Gemma as initialised, from both torch exporters; not the
/// fresh twins of the others), compiled mixed, at batch 2.
#[test]
fn the_plans_of_the_zoo_exports_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    let zoo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/zoo");
    let mut names: Vec<_> = std::fs::read_dir(&zoo).unwrap().flatten().map(|e| e.path()).collect();
    names.retain(|p| p.extension().is_some_and(|e| e == "onnx") && !same_plans_as_another(&zoo, p));
    names.sort();
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for path in &names {
        // A batch of 2 and the exports' sequence of 8 (a legacy nn.MultiheadAttention export
        // holds the length it was traced at), the sequence bound before the passes as `run`
        // binds it (an LSTM over it unrolls).
        let model = mpc::load(path).unwrap();
        let mut dims = HashMap::new();
        for &v in model.inputs() {
            for (axis, d) in model.ty(v).shape.iter().flat_map(|s| s.dims().to_vec()).enumerate() {
                if let Some(s) = d.symbol() {
                    dims.entry(s.to_string()).or_insert(if axis == 0 { 2 } else { 8 });
                }
            }
        }
        let sequence: HashMap<String, u64> =
            dims.iter().filter(|(_, &n)| n == 8).map(|(k, &n)| (k.clone(), n)).collect();
        let mut g = mpc::summary::bind_symbols(&model, &sequence).unwrap();
        let opts = mpc::Options { policy: Some("mixed".into()), ..Default::default() };
        mpc::compile(&mut g, path, &opts, &mut |_, _| {}).unwrap();
        let feeds = mpc::run::random_inputs(&g, 3, &dims).unwrap();
        let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, path).unwrap();
        let label = path.file_name().unwrap().to_string_lossy().to_string();
        // An export whose Dropout stayed in training mode runs on neither device.
        let constant = |t: &TensorRef| program.constant(t);
        if program.launches.iter().any(|l| plan(l, &constant).is_err_and(|e| e.contains("training mode"))) {
            println!("{label}: skipped (Dropout in training mode)");
            continue;
        }
        let t = std::time::Instant::now();
        for op in check_program(&label, &program, &feeds) {
            *seen.entry(op).or_default() += 1;
        }
        println!("{label}: {:.1} s", t.elapsed().as_secs_f64());
    }
    println!("zoo launches checked against the CPU by op: {seen:?}");
    let left: Vec<&String> = seen.keys().filter(|k| k.starts_with("not interpreted")).collect();
    assert!(left.is_empty(), "launches this file cannot check: {left:?}");
}

/// The zoo's training steps (mixed, Adam, each family's loss and labels from zoo.json, torch's
/// batch): every launch's plan computes what the CPU does, GatherGrad, the losses over sequences
/// and the recurrent nets' unrolled steps included.
#[test]
fn the_plans_of_the_zoo_training_steps_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    let zoo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/zoo");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(zoo.join("zoo.json")).unwrap()).unwrap();
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for (family, f) in json.as_object().unwrap() {
        if same_plans_as_another(&zoo, &zoo.join(format!("{family}.dynamo.onnx"))) {
            continue;
        }
        let expected = mpc::run::read_safetensors(&zoo.join(format!("{family}.grads.safetensors"))).unwrap();
        let feeds: HashMap<String, HostTensor> =
            expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
        // Each export, and those with attention again with `--fused-attention`.
        for (export, fused_attention) in ["dynamo", "legacy"].into_iter().flat_map(|e| [(e, false), (e, true)]) {
            let path = zoo.join(format!("{family}.{export}.onnx"));
            // A family torch.export could not export has no dynamo file (zoo.json's `exporters`).
            if !path.exists() {
                continue;
            }
            // As `train` builds the step: the sequence bound from the batch.
            let mut g = mpc::train::bind_sample_dims(&mpc::load(&path).unwrap(), &feeds, &path).unwrap();
            let cfg = mpc::config::TrainFile { loss: f["loss"].as_str().map(String::from), ..Default::default() };
            let (t, _) = cfg.resolve().unwrap();
            let t = mpc_passes::train::TrainOptions { labels: f["labels"].as_str().unwrap().to_string(), ..t };
            let opts =
                mpc::Options { policy: Some("mixed".into()), train: Some(t), fused_attention, ..Default::default() };
            mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
            if fused_attention && !g.node_ids().any(|n| matches!(g.node(n).op, Op::Attention(_))) {
                continue;
            }
            let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, &path).unwrap();
            let label = format!("{family}.{export} train{}", if fused_attention { " fused attention" } else { "" });
            for op in check_program(&label, &program, &feeds) {
                *seen.entry(op).or_default() += 1;
            }
        }
    }
    println!("zoo training launches checked against the CPU by op: {seen:?}");
    // The transformers' attentions fused (BERT, DistilBERT, GPT-2, Llama, ViT, GPT-NeoX, Gemma,
    // torch's TransformerEncoder batch first, not, and with a key padding mask, and torchvision's
    // ViT, two layers each, both exporters).
    assert_eq!((seen.get("Attention"), seen.get("AttentionGrad")), (Some(&44), Some(&44)), "{seen:?}");
    let left: Vec<&String> = seen.keys().filter(|k| k.starts_with("not interpreted")).collect();
    assert!(left.is_empty(), "launches this file cannot check: {left:?}");
}
