//! The MLP of the AWS Neuron `mnist_mlp` sample: 784 → 120 → 84 → 10 with ReLU. It returns logits;
//! the sample's `log_softmax` + NLL loss is exactly the trainer's cross-entropy on them.

use burn::module::{Module, Param};
use burn::tensor::{activation::relu, backend::Backend, Distribution, Tensor, TensorData};

use super::layers::Linear;
use crate::contract::Model;
use crate::ops::{self, KilnBackend};

pub const INPUT: usize = 28 * 28;
pub const CLASSES: usize = 10;

#[derive(Module, Debug)]
pub struct MnistMlp<B: Backend> {
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    pub fc3: Linear<B>,
}

/// PyTorch's `nn.Linear` initialisation: weight and bias ~ U(−1/√in, 1/√in).
fn torch_linear<B: KilnBackend>(d_in: usize, d_out: usize, device: &B::Device) -> Linear<B> {
    let bound = 1.0 / (d_in as f64).sqrt();
    let u = Distribution::Uniform(-bound, bound);
    Linear {
        weight: Param::from_tensor(ops::owned(Tensor::random([d_out, d_in], u, device))),
        bias: Some(Param::from_tensor(ops::owned(Tensor::random(
            [d_out],
            u,
            device,
        )))),
        inference_weight: None,
        parallel: burn::module::Ignored(None),
        lora_a: None,
        lora_b: None,
        lora: burn::module::Ignored(None),
    }
}

impl<B: KilnBackend> MnistMlp<B> {
    pub fn new(device: &B::Device) -> Self {
        Self {
            fc1: torch_linear(INPUT, 120, device),
            fc2: torch_linear(120, 84, device),
            fc3: torch_linear(84, CLASSES, device),
        }
    }

    /// `x [N, 784]` (pixels / 255) → logits `[N, 10]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = relu(self.fc1.forward(x));
        let h = relu(self.fc2.forward(h));
        self.fc3.forward(h)
    }
}

/// Images as pixels / 255, row-major `[n, 784]`.
#[derive(Debug, Clone)]
pub struct PixelBatch {
    pub n: usize,
    pub pixels: Vec<f32>,
}

impl<B: KilnBackend> Model<B> for MnistMlp<B> {
    type Batch = PixelBatch;
    fn logits(&self, batch: &PixelBatch) -> Tensor<B, 2> {
        let device = self.fc1.weight.device();
        let x = Tensor::from_data(
            TensorData::new(batch.pixels.clone(), [batch.n, INPUT]),
            &device,
        );
        self.forward(x)
    }
}
