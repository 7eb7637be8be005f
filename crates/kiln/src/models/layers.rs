//! The few building blocks every architecture shares, with Hugging Face parameter names and layouts.
//!
//! `Linear.weight` is stored `[out_features, in_features]`, exactly as PyTorch and safetensors hold it,
//! so checkpoints load and save without any transpose (Burn's own `nn::Linear` is `[in, out]`: a
//! forgotten transpose on a square weight would load silently wrong).

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, Distribution, Tensor};

/// `y = x Wᵀ + b` over the last dimension.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Linear<B> {
    /// Hugging Face's `_init_weights`: weight ~ N(0, std), bias = 0.
    pub fn new(d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        let weight = Tensor::random([d_out, d_in], Distribution::Normal(0.0, std), device);
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let d_in = dims[D - 1];
        let rows = dims[..D - 1].iter().product::<usize>();
        // One large 2-D GEMM instead of a batch of small ones: better use of the GEMM kernel.
        let y = x
            .reshape([rows, d_in])
            .matmul(self.weight.val().transpose());
        let y = match &self.bias {
            Some(b) => y + b.val().unsqueeze_dim(0),
            None => y,
        };
        let mut out = dims;
        out[D - 1] = y.dims()[1];
        y.reshape(out)
    }
}

/// Layer normalisation over the last dimension (`weight`/`bias` as in PyTorch's `nn.LayerNorm`).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub bias: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    pub fn new(d: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([d], device)),
            bias: Param::from_tensor(Tensor::zeros([d], device)),
            eps,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (var, mean) = x.clone().var_mean_bias(D - 1);
        let x = (x - mean) / (var + self.eps).sqrt();
        x * self.weight.val().unsqueeze() + self.bias.val().unsqueeze()
    }
}

/// A lookup table `[num_embeddings, dim]`.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    pub fn new(n: usize, d: usize, std: f64, device: &B::Device) -> Self {
        let weight = Tensor::random([n, d], Distribution::Normal(0.0, std), device);
        Self {
            weight: Param::from_tensor(weight),
        }
    }

    /// `ids [B, T]` → `[B, T, dim]`.
    pub fn forward(&self, ids: Tensor<B, 2, burn::tensor::Int>) -> Tensor<B, 3> {
        let [b, t] = ids.dims();
        let d = self.weight.dims()[1];
        self.weight
            .val()
            .select(0, ids.reshape([b * t]))
            .reshape([b, t, d])
    }
}

/// Exact (erf) GELU, Hugging Face's `"gelu"`. Written out so autodiff differentiates the erf form:
/// Burn's fused `gelu` backward uses the tanh approximation's derivative, which would not match PyTorch.
pub fn gelu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let cdf = (x.clone() * std::f64::consts::FRAC_1_SQRT_2).erf() + 1.0;
    x * cdf * 0.5
}

/// Inverted dropout, active only when the backend records gradients (training).
pub fn dropout<B: Backend, const D: usize>(x: Tensor<B, D>, prob: f64) -> Tensor<B, D> {
    if !B::ad_enabled() || prob <= 0.0 {
        return x;
    }
    let keep = 1.0 - prob;
    let mask = x.random_like(Distribution::Bernoulli(keep));
    x * mask * (1.0 / keep)
}
