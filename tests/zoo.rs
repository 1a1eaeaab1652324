//! The architecture zoo: models people train, as both torch exporters write them, with a dynamic
//! batch and, for the text models of the `*_seq` families and the TransformerEncoders, a dynamic
//! sequence (tests/models/zoo, made by make_zoo.py). For each export: the training step compiles (mixed),
//! one FP32 step's gradients equal PyTorch autograd's (the expected values are committed; no
//! Python here), and 20 mixed Adam steps on the fixed batch give a finite loss that falls.
//! Every export must pass: the one the exporter made an inference model of (batch norm folded
//! into the convolutions) trains without a comparison.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::scratch;
use mpc::train::{train, TrainConfig};
use mpc_passes::train::{Optimizer, TrainOptions};
use mpc_runtime::HostTensor;

fn zoo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/zoo")
}

struct Family {
    name: String,
    loss: String,
    labels: String,
    /// Exports in which the exporter folded BatchNormalization into the convolutions: a model
    /// for inference, whose gradients are not torch's (it still trains).
    folded: Vec<String>,
    /// How many parameters torch trains, where the test checks that mpc trains as many (the
    /// fresh families, whose exports merge and drop parameters).
    parameters: Option<usize>,
    /// The exports hold a fixed batch (no dynamic axes).
    fixed_batch: bool,
    /// The exports have a dynamic sequence axis beside the batch.
    dynamic_seq: bool,
    /// The exporters that wrote the family (torch.export cannot export some models).
    exporters: Vec<String>,
}

fn families() -> Vec<Family> {
    let text = std::fs::read_to_string(zoo().join("zoo.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_object()
        .unwrap()
        .iter()
        .map(|(name, f)| Family {
            name: name.clone(),
            loss: f["loss"].as_str().unwrap().to_string(),
            labels: f["labels"].as_str().unwrap().to_string(),
            folded: f["batch_norm_folded"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e.as_str().unwrap().to_string())
                .collect(),
            parameters: f.get("parameters").map(|n| n.as_u64().unwrap() as usize),
            fixed_batch: f.get("axes").and_then(|a| a.as_str()) == Some("none"),
            dynamic_seq: f.get("axes").and_then(|a| a.as_str()) == Some("batch+seq"),
            exporters: f.get("exporters").and_then(|e| e.as_array()).map_or_else(
                || vec!["legacy".into(), "dynamo".into()],
                |e| e.iter().map(|x| x.as_str().unwrap().to_string()).collect(),
            ),
        })
        .collect()
}

fn train_options(f: &Family, optimizer: Optimizer, lr: f32) -> TrainOptions {
    let cfg = mpc::config::TrainFile { loss: Some(f.loss.clone()), ..Default::default() };
    let (t, _) = cfg.resolve().unwrap();
    TrainOptions { labels: f.labels.clone(), optimizer, lr, ..t }
}

/// One FP32 SGD step's gradients against torch's: the worst relative L2 error over parameters.
fn gradients(f: &Family, path: &Path, expected: &HashMap<String, HostTensor>) -> Result<f64, String> {
    let inputs: HashMap<_, _> =
        expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
    // As `train` builds the step: the sequence length (any dim but the batch) bound from the data.
    let loaded = mpc::load(path).map_err(|e| e.to_string())?;
    let mut g = mpc::train::bind_sample_dims(&loaded, &inputs, path).map_err(|e| e.to_string())?;
    let t = train_options(f, Optimizer::Sgd, 0.1);
    let opts = mpc::Options { policy: Some("fp32".into()), train: Some(t), ..Default::default() };
    mpc::compile(&mut g, path, &opts, &mut |_, _| {}).map_err(|e| e.to_string())?;
    // The expected gradients are keyed by the initializer names of both exports; a tied copy
    // is no longer one (the weight it was tied to has the gradient of both uses, as in torch).
    let inits: std::collections::HashSet<String> = g.initializers().map(|v| g.name(v).to_string()).collect();
    // mpc trains exactly torch's parameters: no buffer (a rotary table, a mask) as a weight. (The
    // parameters as `compile` finds them: in the model as loaded, after tying.)
    let mut model = mpc::load(path).map_err(|e| e.to_string())?;
    let candidates = mpc_passes::train::tie_candidates(&model, &Default::default());
    mpc_passes::train::tie_weights(&mut model, &candidates);
    let trained = mpc_passes::train::trainable(&model, &Default::default());
    // Or reports them: constants a fixed-shape dynamo export folded from parameters it no longer
    // holds (a class token expanded to the batch) train as weights of their own, and say so.
    let reported = mpc_passes::train::folded_weights(&model, &trained).map(|(own, _)| own).unwrap_or_default();
    let extra: Vec<&str> = trained
        .iter()
        .map(|&v| model.name(v))
        .filter(|n| !expected.contains_key(&format!("grad.{n}")) && !reported.iter().any(|r| r == n))
        .collect();
    if !extra.is_empty() {
        return Err(format!("trains initializers torch does not: {extra:?}"));
    }
    if let Some(n) = f.parameters.filter(|&n| n != trained.len()) {
        let names: Vec<&str> = trained.iter().map(|&v| model.name(v)).collect();
        return Err(format!("trains {} parameters where torch trains {n}: {names:?}", trained.len()));
    }
    let mut wanted = Vec::new();
    for k in expected.keys().filter_map(|k| k.strip_prefix("grad.")).filter(|k| inits.contains(*k)) {
        // The gradient the update reads (a weight read through a Transpose, as an export without
        // constant folding writes it, has its gradient made by the transposed product directly).
        let update = || common::training::update_of(&g, k).input(1);
        let v = g.find(&format!("{k}.grad")).or_else(update).ok_or_else(|| format!("no gradient for `{k}`"))?;
        g.add_output(v);
        wanted.push((k.to_string(), v));
    }
    let out: HashMap<String, _> =
        mpc::run::run_once(&g, &inputs, path).map_err(|e| e.to_string())?.into_iter().collect();
    let (loss, want) = (out["loss"].f64s()[0], expected["loss"].f64s()[0]);
    if (loss - want).abs() > 1e-5 * want.abs().max(1.0) {
        return Err(format!("loss {loss} where torch has {want}"));
    }
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let largest = wanted.iter().map(|(k, _)| norm(&expected[&format!("grad.{k}")].f64s())).fold(0.0, f64::max);
    let mut worst = 0f64;
    for (k, v) in &wanted {
        let (a, b) = (out[g.name(*v)].f64s(), expected[&format!("grad.{k}")].f64s());
        let diff: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        // A gradient that vanishes in exact arithmetic (a bias under a softmax) must be
        // rounding-sized in mpc too.
        let rel = if norm(&b) < 1e-6 * largest { norm(&a) / largest } else { norm(&diff) / norm(&b) };
        if rel > 1e-4 {
            return Err(format!("d loss / d {k}: relative error {rel:.2e} against torch"));
        }
        worst = worst.max(rel);
    }
    Ok(worst)
}

/// 20 mixed-precision Adam steps on the fixed batch: the losses, all finite, and the last below
/// the first.
fn trains(f: &Family, path: &Path, expected: &HashMap<String, HostTensor>) -> Result<(f32, f32), String> {
    let g = mpc::load(path).map_err(|e| e.to_string())?;
    let mut data: Vec<(String, HostTensor)> =
        expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
    let (mut batch, mut epochs) = (data[0].1.shape[0], 20);
    if f.fixed_batch {
        // Trained at another batch than the export's, and a short last one: the samples
        // repeated to 5, in batches of 3 and 2.
        for (_, t) in &mut data {
            let row: usize = t.shape[1..].iter().product();
            let flat: Vec<usize> = (0..5).flat_map(|i| (i % t.shape[0]) * row..(i % t.shape[0] + 1) * row).collect();
            *t = t.pick([&[5], &t.shape[1..]].concat(), &flat);
        }
        (batch, epochs) = (3, 10);
    }
    let file = scratch(&format!("zoo-{}", path.file_stem().unwrap().to_string_lossy())).join("data.safetensors");
    mpc::run::write_safetensors(&file, &data).map_err(|e| e.to_string())?;
    let t = train_options(f, Optimizer::Adam, 3e-3);
    let opts = mpc::Options { policy: Some("mixed".into()), train: Some(t), ..Default::default() };
    let cfg = TrainConfig { data: vec![file], epochs, batch, ..Default::default() };
    let run = train(&g, path, &opts, &cfg, &mut |_| {}).map_err(|e| e.to_string())?;
    let losses: Vec<f32> = run.losses.iter().zip(&run.skipped).filter(|(_, &s)| !s).map(|(&l, _)| l).collect();
    let (first, last) = (losses.first().copied().unwrap_or(f32::NAN), losses.last().copied().unwrap_or(f32::NAN));
    if losses.len() < 10 || !losses.iter().all(|l| l.is_finite()) || last >= first {
        return Err(format!("mixed training: losses {:?}", run.losses));
    }
    Ok((first, last))
}

#[test]
fn every_export_trains_and_matches_torch() {
    let mut unexpected = Vec::new();
    for f in families() {
        let expected = mpc::run::read_safetensors(&zoo().join(format!("{}.grads.safetensors", f.name))).unwrap();
        for exporter in ["legacy", "dynamo"] {
            let stem = format!("{}.{exporter}", f.name);
            let path = zoo().join(format!("{stem}.onnx"));
            if !f.exporters.iter().any(|e| e == exporter) {
                continue;
            }
            if f.folded.iter().any(|e| e == exporter) {
                match trains(&f, &path, &expected) {
                    Ok((first, last)) => println!(
                        "{stem}: the exporter folded BatchNormalization into the convolutions, so no torch gradients to compare; mixed loss {first:.4} -> {last:.4}"
                    ),
                    Err(e) => unexpected.push(format!("{stem}: {e}")),
                }
                continue;
            }
            let result = gradients(&f, &path, &expected).and_then(|worst| Ok((worst, trains(&f, &path, &expected)?)));
            match result {
                Ok((worst, (first, last))) => {
                    println!("{stem}: gradients match torch (worst {worst:.1e}); mixed loss {first:.4} -> {last:.4}")
                }
                Err(e) => unexpected.push(format!("{stem}: {e}")),
            }
        }
    }
    assert!(unexpected.is_empty(), "{}", unexpected.join("\n"));
}

#[test]
fn a_tied_lm_head_trains_as_one_parameter_unless_asked_not_to() {
    let model = zoo().join("gpt2.legacy.onnx");
    let out = scratch("zoo-tie").join("step.onnx");
    let args = ["compile", model.to_str().unwrap(), "--train", "--loss", "cross-entropy:axis=-1", "-o"];
    let o = common::mpc(&[&args[..], &[out.to_str().unwrap()]].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("is the transpose of `m.transformer.wte.weight`: trained as that one parameter"),
        "{stderr}"
    );
    let o = common::mpc(&[&args[..], &[out.to_str().unwrap(), "--no-tie"]].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !stderr.contains("transpose of"), "{stderr}");
}

/// `--fused-attention` on the transformer exports (PyTorch's scaled_dot_product_attention as both
/// exporters write it: the scale split over Q and Kᵀ, an additive mask or none, the softmax's NaN
/// rows zeroed by a Where): every attention becomes one Attention node, and a mixed SGD step on
/// the CPU, on the export's committed batch, gives the loss and every weight's update of the
/// unfused step within f16 rounding (the fused scores are summed in f32, not rounded first).
#[test]
fn the_fused_attention_takes_every_transformer_export_and_trains_as_its_chains() {
    use mpc_runtime::device::{CpuDevice, Device};
    use mpc_runtime::session::Session;
    let rel_l2 = 2e-3;
    let mut fused_exports = 0;
    for f in families() {
        let expected = mpc::run::read_safetensors(&zoo().join(format!("{}.grads.safetensors", f.name))).unwrap();
        let inputs: HashMap<_, _> =
            expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
        for exporter in ["legacy", "dynamo"] {
            let stem = format!("{}.{exporter}", f.name);
            let path = zoo().join(format!("{stem}.onnx"));
            if !f.exporters.iter().any(|e| e == exporter) {
                continue;
            }
            let build = |fused_attention: bool| {
                let mut g = mpc::train::bind_sample_dims(&mpc::load(&path).unwrap(), &inputs, &path).unwrap();
                // A first loss scale that overflows no gradient: the step is taken, not skipped.
                let dynamic_scale = mpc_passes::train::DynamicScale { init: 256.0, ..Default::default() };
                let train = Some(TrainOptions { dynamic_scale, ..train_options(&f, Optimizer::Sgd, 0.1) });
                let opts = mpc::Options { policy: Some("mixed".into()), train, fused_attention, ..Default::default() };
                mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
                let softmaxes = g.node_ids().filter(|&n| matches!(g.node(n).op, mpc_ir::Op::Softmax(_))).count();
                (mpc::run::lower_for_inputs(&g, &inputs, CpuDevice::default().caps(), &path).unwrap(), softmaxes)
            };
            let ((fused, left), (plain, softmaxes)) = (build(true), build(false));
            let count =
                |p: &mpc_runtime::program::Program, kind: &str| p.launches.iter().filter(|l| l.kind() == kind).count();
            assert_eq!((count(&fused, "Attention"), left), (softmaxes, 0), "{stem}: attentions fused, softmaxes left");
            if softmaxes == 0 {
                continue;
            }
            assert_eq!(count(&fused, "AttentionGrad"), softmaxes, "{stem}");
            fused_exports += 1;
            let state: Vec<String> = fused.state.iter().map(|s| s.name.clone()).collect();
            let mut s = [fused, plain].map(|p| Session::new(CpuDevice::default(), p).unwrap());
            let (updated, worst) = common::training::compare_one_step(&stem, &mut s, &state, &inputs, rel_l2);
            assert!(updated >= 10, "{stem}: {updated} weights updated");
            println!(
                "{stem}: {softmaxes} attentions fused; {updated} weights' updates within {worst:.2e} (relative L2) of the unfused step's"
            );
        }
    }
    // BERT, DistilBERT, GPT-2, Llama and ViT, the fresh BERT, GPT-2, Llama, ViT, GPT-NeoX and
    // Gemma, BERT, DistilBERT, GPT-2 and Llama with a dynamic sequence, torch's TransformerEncoder
    // (batch first and not) and torchvision's ViT, by both exporters; BERT, GPT-2 and ViT exported
    // with a fixed batch (legacy).
    assert_eq!(fused_exports, 41);
}

/// GPT-2 exported with a dynamic sequence axis (both exporters) trains at two sequence lengths in
/// one run: shards of length 8 and of length 4 are two buckets, each batch of one, the step
/// compiled for each length over one state. The trainer's steps, alternating lengths, are bit for
/// bit those of two trainers of one length each that hand the state over at every step; and a
/// mixed run over both shards lowers its loss.
#[test]
fn two_sequence_lengths_train_in_one_run() {
    use mpc::trainer::Trainer;
    use mpc_runtime::device::CpuDevice;
    for export in ["gpt2_seq.legacy.onnx", "gpt2_seq.dynamo.onnx"] {
        let path = zoo().join(export);
        let model = mpc::load(&path).unwrap();
        let expected = mpc::run::read_safetensors(&zoo().join("gpt2_seq.grads.safetensors")).unwrap();
        // Eight samples of length 8 (the export's two, repeated), and their first 4 tokens.
        let of_length = |len: usize| -> Vec<(String, HostTensor)> {
            ["input_ids", "labels"]
                .iter()
                .map(|&k| {
                    let t = &expected[&format!("input.{k}")];
                    let idx: Vec<usize> = (0..8).flat_map(|i| (0..len).map(move |j| (i % 2) * 8 + j)).collect();
                    (k.to_string(), t.pick(vec![8, len], &idx))
                })
                .collect()
        };
        let dir = scratch(&format!("two_lengths_{export}"));
        let shards = [8, 4].map(|len| {
            let file = dir.join(format!("len{len}.safetensors"));
            mpc::run::write_safetensors(&file, &of_length(len)).unwrap();
            file
        });
        let batch = |len: usize, k: usize| -> HashMap<String, HostTensor> {
            of_length(len).into_iter().map(|(n, t)| (n, mpc::trainer::rows(&t, &[2 * k, 2 * k + 1], None))).collect()
        };
        let t = TrainOptions {
            loss: mpc_passes::train::Loss::CrossEntropy(mpc_passes::train::CrossEntropy {
                axis: -1,
                ..Default::default()
            }),
            optimizer: Optimizer::Sgd,
            lr: 0.1,
            ..Default::default()
        };
        let opts = mpc::Options { policy: Some("fp32".into()), train: Some(t), ..Default::default() };
        let dev = CpuDevice::default;
        let mut both = Trainer::new(dev(), &model, &path, &opts, &batch(8, 0)).unwrap();
        let mut long = Trainer::new(dev(), &model, &path, &opts, &batch(8, 0)).unwrap();
        let mut short = Trainer::new(dev(), &model, &path, &opts, &batch(4, 0)).unwrap();
        short.load_state(&long.state().unwrap().into_iter().collect(), &path).unwrap();
        let mut handed = true;
        for k in 0..4 {
            let len = if k % 2 == 0 { 8 } else { 4 };
            let h = both.step(&batch(len, k)).unwrap();
            let a = both.wait(h).unwrap().loss;
            let (one, other) = if len == 8 { (&mut long, &mut short) } else { (&mut short, &mut long) };
            let h = one.step(&batch(len, k)).unwrap();
            let b = one.wait(h).unwrap().loss;
            assert_eq!(a, b, "{export}: step {k} (length {len})");
            other.load_state(&one.state().unwrap().into_iter().collect(), &path).unwrap();
            handed &= both.state().unwrap() == one.state().unwrap();
        }
        assert!(handed, "{export}: the state of the two-length trainer differs");

        let t = train_options_lm();
        let opts = mpc::Options { policy: Some("mixed".into()), train: Some(t), ..Default::default() };
        let cfg = TrainConfig { data: shards.to_vec(), epochs: 10, batch: 2, seed: 1, ..Default::default() };
        let run = train(&model, &path, &opts, &cfg, &mut |_| {}).unwrap();
        assert_eq!(run.losses.len(), 80, "{export}: 4 batches of each length per epoch");
        let mean = |l: &[f32]| l.iter().map(|&x| f64::from(x)).sum::<f64>() / l.len() as f64;
        let (first, last) = (mean(&run.losses[..8]), mean(&run.losses[72..]));
        assert!(run.losses.iter().all(|l| l.is_finite()) && last < first, "{export}: {first} then {last}");
        println!("{export}: two lengths in one run, loss {first:.3} -> {last:.3} over 10 epochs (mixed)");
    }
}

/// Every export with a dynamic sequence axis (the `batch+seq` families: BERT, DistilBERT, GPT-2,
/// Llama, the LSTM, GRU and BiLSTM, the TransformerEncoders) trains at two sequence lengths in one
/// run: shards of length 8 and 4 (the committed batch's samples, cut; labels with a sequence axis
/// too), 5 epochs of mixed Adam steps, every loss finite and the last epoch's below the first's.
/// A legacy nn.MultiheadAttention export holds the length it was traced at (as onnxruntime finds
/// too): at another, one line names the Reshape that holds it and the input that gave the length.
#[test]
fn every_sequence_export_trains_at_two_lengths_in_one_run() {
    let mut failed = Vec::new();
    let mut seen = 0;
    for f in families().iter().filter(|f| f.dynamic_seq) {
        let expected = mpc::run::read_safetensors(&zoo().join(format!("{}.grads.safetensors", f.name))).unwrap();
        let inputs: Vec<(String, HostTensor)> =
            expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
        // Eight samples (the committed two, repeated), cut to `len` along every sequence axis.
        let of_length = |len: usize| -> Vec<(String, HostTensor)> {
            inputs
                .iter()
                .map(|(k, t)| {
                    let (shape, idx): (Vec<usize>, Vec<usize>) = match t.shape[..] {
                        [2, 8] => (vec![8, len], (0..8).flat_map(|i| (0..len).map(move |j| (i % 2) * 8 + j)).collect()),
                        [2] => (vec![8], (0..8).map(|i| i % 2).collect()),
                        _ => panic!("{}: input `{k}` of shape {:?}", f.name, t.shape),
                    };
                    (k.clone(), t.pick(shape, &idx))
                })
                .collect()
        };
        for e in &f.exporters {
            let export = format!("{}.{e}.onnx", f.name);
            let path = zoo().join(&export);
            let dir = scratch(&format!("lengths_{export}"));
            let shards: Vec<PathBuf> = [8, 4]
                .iter()
                .map(|&len| {
                    let file = dir.join(format!("len{len}.safetensors"));
                    mpc::run::write_safetensors(&file, &of_length(len)).unwrap();
                    file
                })
                .collect();
            let model = mpc::load(&path).unwrap();
            let t = train_options(f, Optimizer::Adam, 3e-3);
            let opts = mpc::Options { policy: Some("mixed".into()), train: Some(t), ..Default::default() };
            let cfg = TrainConfig { data: shards, epochs: 5, batch: 2, seed: 1, ..Default::default() };
            let result = train(&model, &path, &opts, &cfg, &mut |_| {});
            if HOLDS_LENGTH.contains(&export.as_str()) {
                // The Reshape that holds the traced length, and the input that gave the other.
                let want = ["(Reshape): cannot reshape [4,batch,32]", "the data's `seq` is 4 (input `tokens` axis 1)"];
                match result {
                    Err(e) if want.iter().all(|w| e.to_string().contains(w)) && e.exit_code() == 2 => seen += 1,
                    Err(e) => failed.push(format!("{export}: not the message wanted: {e}")),
                    Ok(_) => failed.push(format!("{export}: trained at a length its graph does not hold")),
                }
                continue;
            }
            let run = match result {
                Ok(run) => run,
                Err(err) => {
                    failed.push(format!("{export}: {err}"));
                    continue;
                }
            };
            let mean = |l: &[f32]| l.iter().map(|&x| f64::from(x)).sum::<f64>() / l.len() as f64;
            let n = run.losses.len();
            let (first, last) = (mean(&run.losses[..8]), mean(&run.losses[n.saturating_sub(8)..]));
            if n != 40 || !run.losses.iter().all(|l| l.is_finite()) || last >= first {
                failed.push(format!("{export}: {n} steps, loss {first} then {last}: {:?}", run.losses));
                continue;
            }
            println!("{export}: lengths 8 and 4 in one run, loss {first:.3} -> {last:.3} over 5 epochs (mixed)");
            seen += 1;
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
    assert_eq!(seen, 19, "exports with a dynamic sequence");
}

/// The exports whose graph holds the sequence length they were traced at: torch's legacy exporter
/// writes nn.MultiheadAttention's head split with the length as a constant.
const HOLDS_LENGTH: [&str; 3] = ["encoder.legacy.onnx", "encoder_padded.legacy.onnx", "encoder_seq_first.legacy.onnx"];

fn train_options_lm() -> TrainOptions {
    let cfg =
        mpc::config::TrainFile { loss: Some("cross-entropy:axis=-1".into()), lr: Some(3e-3), ..Default::default() };
    cfg.resolve().unwrap().0
}
