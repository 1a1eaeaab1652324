//! Synthetic models for benchmarks: generated, never committed.

use mpc_ir::ops::{BatchNormAttrs, ConvAttrs, FlattenAttrs, GemmAttrs, PoolAttrs};
use mpc_ir::{DType, Dim, Graph, Op, Shape, Tensor, TypeInfo, ValueId};

/// Deterministic pseudo-random weights (xorshift), scaled like He initialisation.
struct Weights(u64);

impl Weights {
    fn tensor(&mut self, shape: &[u64], scale: f32) -> Tensor {
        let n: u64 = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect();
        Tensor::from_f32(shape.to_vec(), &values)
    }
}

struct Builder {
    g: Graph,
    w: Weights,
}

impl Builder {
    fn conv(&mut self, name: &str, x: ValueId, cin: u64, cout: u64, k: u64, stride: i64) -> ValueId {
        let scale = (2.0 / (cin * k * k) as f32).sqrt();
        let w = self.g.add_initializer(&format!("{name}.weight"), self.w.tensor(&[cout, cin, k, k], scale));
        let p = (k / 2) as i64;
        let attrs = ConvAttrs {
            kernel_shape: vec![k as i64; 2],
            pads: vec![p; 4],
            strides: vec![stride; 2],
            ..Default::default()
        };
        let (_, out) = self.g.add_op(name, Op::Conv(Box::new(attrs)), &[Some(x), Some(w)], 1);
        out[0]
    }

    fn bn(&mut self, name: &str, x: ValueId, c: u64) -> ValueId {
        let param = |b: &mut Self, what: &str, base: f32, spread: f32| {
            let t = b.w.tensor(&[c], spread);
            let v: Vec<f32> = t.to_f64_vec().iter().map(|x| base + *x as f32).collect();
            Some(b.g.add_initializer(&format!("{name}.{what}"), Tensor::from_f32(vec![c], &v)))
        };
        let ins = [
            Some(x),
            param(self, "weight", 1.0, 0.1),
            param(self, "bias", 0.0, 0.1),
            param(self, "running_mean", 0.0, 0.1),
            param(self, "running_var", 1.0, 0.1),
        ];
        let (_, out) = self.g.add_op(name, Op::BatchNormalization(BatchNormAttrs::default()), &ins, 1);
        out[0]
    }

    fn relu(&mut self, name: &str, x: ValueId) -> ValueId {
        self.g.add_op(name, Op::Relu, &[Some(x)], 1).1[0]
    }

    fn block(&mut self, name: &str, x: ValueId, cin: u64, cout: u64, stride: i64) -> ValueId {
        let a = self.conv(&format!("{name}.conv1"), x, cin, cout, 3, stride);
        let a = self.bn(&format!("{name}.bn1"), a, cout);
        let a = self.relu(&format!("{name}.relu1"), a);
        let b = self.conv(&format!("{name}.conv2"), a, cout, cout, 3, 1);
        let b = self.bn(&format!("{name}.bn2"), b, cout);
        let skip = if stride != 1 || cin != cout {
            let d = self.conv(&format!("{name}.downsample.0"), x, cin, cout, 1, stride);
            self.bn(&format!("{name}.downsample.1"), d, cout)
        } else {
            x
        };
        let (_, s) = self.g.add_op(&format!("{name}.add"), Op::Add, &[Some(b), Some(skip)], 1);
        self.relu(&format!("{name}.relu2"), s[0])
    }
}

/// ResNet-18 for 224×224 images (11.7M parameters, 46.8 MB of f32 weights), inference form.
pub fn resnet18() -> Graph {
    let mut b = Builder { g: Graph::new("resnet18"), w: Weights(0x2545f4914f6cdd1d) };
    b.g.meta.opsets = vec![(String::new(), 17)];
    b.g.meta.ir_version = 8;
    let shape = Shape(vec![Dim::sym("batch"), Dim::Fixed(3), Dim::Fixed(224), Dim::Fixed(224)]);
    let x = b.g.add_input("input", TypeInfo::new(DType::F32, shape));
    let mut h = b.conv("conv1", x, 3, 64, 7, 2);
    h = b.bn("bn1", h, 64);
    h = b.relu("relu", h);
    let pool = PoolAttrs { kernel_shape: vec![3, 3], pads: vec![1; 4], strides: vec![2, 2], ..Default::default() };
    h = b.g.add_op("maxpool", Op::MaxPool(Box::new(pool)), &[Some(h)], 1).1[0];
    let mut cin = 64;
    for (stage, cout) in [64u64, 128, 256, 512].into_iter().enumerate() {
        for i in 0..2 {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            h = b.block(&format!("layer{}.{i}", stage + 1), h, cin, cout, stride);
            cin = cout;
        }
    }
    h = b.g.add_op("avgpool", Op::GlobalAveragePool, &[Some(h)], 1).1[0];
    h = b.g.add_op("flatten", Op::Flatten(FlattenAttrs { axis: 1 }), &[Some(h)], 1).1[0];
    let w = b.g.add_initializer("fc.weight", b.w.tensor(&[1000, 512], (1.0f32 / 512.0).sqrt()));
    let bias = b.g.add_initializer("fc.bias", b.w.tensor(&[1000], 0.01));
    let gemm = GemmAttrs { transB: true, ..Default::default() };
    let (_, out) = b.g.add_op("fc", Op::Gemm(gemm), &[Some(h), Some(w), Some(bias)], 1);
    b.g.add_output(out[0]);
    b.g
}

/// A chain of `n` nodes cycling through MatMul, Add, Relu and Softmax on a [batch, 64]
/// activation, for compile-time scaling measurements.
pub fn chain(n: usize) -> Graph {
    let mut g = Graph::new(format!("chain{n}"));
    g.meta.opsets = vec![(String::new(), 17)];
    g.meta.ir_version = 8;
    let x = g.add_input("x", TypeInfo::new(DType::F32, Shape(vec![Dim::sym("batch"), Dim::Fixed(64)])));
    let w = g.add_initializer("w", Tensor::from_f32(vec![64, 64], &[0.01; 64 * 64]));
    let bias = g.add_initializer("b", Tensor::from_f32(vec![64], &[0.0; 64]));
    let mut h = x;
    for i in 0..n {
        let (op, inputs) = match i % 4 {
            0 => (Op::MatMul, vec![Some(h), Some(w)]),
            1 => (Op::Add, vec![Some(h), Some(bias)]),
            2 => (Op::Relu, vec![Some(h)]),
            _ => (Op::Softmax(Default::default()), vec![Some(h)]),
        };
        h = g.add_op(&format!("n{i}"), op, &inputs, 1).1[0];
    }
    g.add_output(h);
    g
}

/// One input read by `n` MatMuls whose results meet in a single Sum: the shape that makes a pass
/// quadratic if it rewires the readers of a widely read value one at a time.
pub fn fan_out(n: usize) -> Graph {
    let mut g = Graph::new(format!("fanout{n}"));
    g.meta.opsets = vec![(String::new(), 17)];
    g.meta.ir_version = 8;
    let x = g.add_input("x", TypeInfo::new(DType::F32, Shape(vec![Dim::sym("batch"), Dim::Fixed(8)])));
    let w = g.add_initializer("w", Tensor::from_f32(vec![8, 8], &[0.01; 64]));
    let outs: Vec<Option<ValueId>> =
        (0..n).map(|i| Some(g.add_op(&format!("mm{i}"), Op::MatMul, &[Some(x), Some(w)], 1).1[0])).collect();
    let (_, sum) = g.add_op("sum", Op::Sum, &outs, 1);
    g.add_output(sum[0]);
    g
}
