//! The few building blocks every architecture shares, with Hugging Face parameter names and layouts.
//!
//! `Linear.weight` is stored `[out_features, in_features]`, exactly as PyTorch and safetensors hold it,
//! so checkpoints load and save without any transpose (Burn's own `nn::Linear` is `[in, out]`: a
//! forgotten transpose on a square weight would load silently wrong).

use std::ops::Range;

use burn::module::{Ignored, Module, Param};
use burn::tensor::{backend::Backend, Distribution, Tensor};

use crate::ops::{self, KilnBackend, TpComm};

/// `y = x Wᵀ + b` over the last dimension, plus a LoRA adapter's `s · B A x` where one is attached.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The weight as the backend's inference products read it instead (`[in, out]`, or panels on
    /// an AVX-512 CPU), for a model that only runs forward (see [`Linear::into_inference_layout`]);
    /// a constant, neither trained nor saved.
    pub inference_weight: Option<Tensor<B, 2>>,
    /// This layer's part in a tensor-parallel group (`None`: a whole layer on its own).
    pub parallel: Ignored<Option<ParallelLinear>>,
    /// LoRA's down-projection `[r, in]` (PEFT's `lora_A`), when an adapter is attached
    /// ([`crate::models::lora`], which also maps these paths to PEFT's names).
    pub lora_a: Option<LoraFactor<B>>,
    /// LoRA's up-projection `[out, r]` (PEFT's `lora_B`).
    pub lora_b: Option<LoraFactor<B>>,
    /// The adapter's scaling and dropout (constants).
    pub lora: Ignored<Option<LoraScale>>,
}

/// One LoRA matrix, a module of its own so that its parameter is `<layer>.lora_a.weight`, as
/// PEFT's `<layer>.lora_A.weight`.
#[derive(Module, Debug)]
pub struct LoraFactor<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

/// What multiplies a LoRA adapter's product: `alpha / r` (`alpha / √r` with rsLoRA), and the
/// dropout applied to its input (PEFT's `lora_dropout`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraScale {
    pub scaling: f64,
    pub dropout: f64,
}

/// How a [`Linear`] takes part in a tensor-parallel group: Megatron's and candle's layer types,
/// as a role of the one layer type so that parameter names stay Hugging Face's.
#[derive(Debug, Clone)]
pub enum ParallelLinear {
    /// `ColumnParallelLinear`: this rank's output features. Its input must already be the
    /// group's (`ops::tp_enter`, once per block, where q/k/v or gate/up share one input), and its
    /// output stays this rank's. The group is for a LoRA adapter's whole `A`.
    Column(TpComm),
    /// `RowParallelLinear`: this rank's input features `cols` of `full`; the ranks' partial
    /// products are summed over the group, then the whole bias is added once.
    Row {
        tp: TpComm,
        cols: Range<usize>,
        full: usize,
    },
    /// The whole layer on every rank, which keeps output features `keep` (key/value heads
    /// replicated because there are fewer than ranks); the weight's gradient is summed over the
    /// group, so the copies stay equal.
    ReplicatedKeep { tp: TpComm, keep: Range<usize> },
}

impl<B: KilnBackend> Linear<B> {
    /// Hugging Face's `_init_weights`: weight ~ N(0, std), bias = 0.
    pub fn new(d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        let weight = Tensor::random([d_out, d_in], Distribution::Normal(0.0, std), device);
        Self {
            weight: Param::from_tensor(ops::owned(weight)),
            bias: bias.then(|| Param::from_tensor(ops::owned(Tensor::zeros([d_out], device)))),
            inference_weight: None,
            parallel: Ignored(None),
            lora_a: None,
            lora_b: None,
            lora: Ignored(None),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.lora.0.is_none() {
            return self.base_forward(x);
        }
        let y = self.base_forward(x.clone());
        match self.lora_delta(x) {
            Some(delta) => y + delta,
            None => y,
        }
    }

    /// The adapter's part of the output, `s · B A dropout(x)`, shaped like the layer's output;
    /// `None` without an adapter. Under tensor parallelism the two factors take the roles
    /// Megatron's and NxD's LoRA layers give them: beside a column-parallel weight `A` is whole
    /// (its gradient summed over the group) and `B` is cut by rows like the weight; beside a
    /// row-parallel one `A` is cut by columns, its partial products summed over the group, and
    /// `B` is whole.
    pub fn lora_delta<const D: usize>(&self, x: Tensor<B, D>) -> Option<Tensor<B, D>> {
        let (Some(a), Some(b), Some(scale)) = (&self.lora_a, &self.lora_b, &self.lora.0) else {
            return None;
        };
        let (a, b) = (a.weight.val(), b.weight.val());
        let x = match &self.parallel.0 {
            Some(ParallelLinear::Row { cols, full, .. }) => {
                column_dropout(x, scale.dropout, cols, *full)
            }
            _ => ops::dropout(x, scale.dropout),
        };
        Some(match &self.parallel.0 {
            None => ops::linear(ops::linear(x, a, None) * scale.scaling, b, None),
            Some(ParallelLinear::Column(tp)) => {
                // The input is the group's already; A is replicated: its gradient is summed.
                let a = ops::tp_enter(a, tp);
                ops::linear(ops::linear(x, a, None) * scale.scaling, b, None)
            }
            Some(ParallelLinear::Row { tp, .. }) => {
                let z = ops::tp_sum(ops::linear(x, a, None), tp);
                ops::linear(z * scale.scaling, b, None)
            }
            Some(ParallelLinear::ReplicatedKeep { tp, keep }) => {
                let (a, b) = (ops::tp_enter(a, tp), ops::tp_enter(b, tp));
                let y = ops::linear(ops::linear(x, a, None) * scale.scaling, b, None);
                y.narrow(D - 1, keep.start, keep.len())
            }
        })
    }

    /// `x Wᵀ + b` alone, in this layer's tensor-parallel role.
    fn base_forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        match (&self.parallel.0, &self.inference_weight) {
            (None | Some(ParallelLinear::Column(_)), Some(w)) => {
                ops::linear_in_out(x, w.clone(), bias)
            }
            (None | Some(ParallelLinear::Column(_)), None) => {
                ops::linear(x, self.weight.val(), bias)
            }
            (Some(ParallelLinear::Row { tp, .. }), _) => {
                let y = ops::tp_sum(ops::linear(x, self.weight.val(), None), tp);
                match bias {
                    Some(b) => y + b.unsqueeze::<D>(),
                    None => y,
                }
            }
            (Some(ParallelLinear::ReplicatedKeep { tp, keep }), _) => {
                let w = ops::tp_enter(self.weight.val(), tp);
                let bias = bias.map(|b| ops::tp_enter(b, tp));
                ops::linear(x, w, bias).narrow(D - 1, keep.start, keep.len())
            }
        }
    }

    /// The same layer for inference only, its weight moved to the backend's inference layout
    /// ([`ops::inference_layout`]; no second copy: the `[out, in]` parameter is left empty, so
    /// saving or training this layer fails on the shape instead of going wrong). A GEMM of a few
    /// hundred rows packs its `[out, in]` operand strided on every call; from `[in, out]` the
    /// packing reads rows (prefill's `down_proj`: 302 against 444 GFLOP/s on Zen 5, 111 against
    /// 173 on Zen 4), and from an AVX-512 CPU's panels there is no packing left to do.
    pub fn into_inference_layout(self) -> Self {
        if self.inference_weight.is_some() {
            return self;
        }
        let w = self.weight.val();
        let [_, d_in] = w.dims();
        let device = w.device();
        Self {
            inference_weight: Some(ops::inference_layout(w)),
            weight: self.weight.map(|_| Tensor::zeros([0, d_in], &device)),
            ..self
        }
    }
}

/// Dropout of the input columns `cols` of a `full`-wide input with the mask the whole input
/// would get: a row-parallel layer's adapter then drops the same values at every tensor-parallel
/// size (the mask is drawn per element index, so a cut input drawn on its own would get other
/// values than tensor-parallel size 1 gives it).
fn column_dropout<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    prob: f64,
    cols: &Range<usize>,
    full: usize,
) -> Tensor<B, D> {
    if !B::ad_enabled() || prob <= 0.0 {
        return x;
    }
    let mut dims = x.dims();
    dims[D - 1] = full;
    let mask = ops::dropout(Tensor::<B, D>::ones(dims, &x.device()), prob);
    x * mask.narrow(D - 1, cols.start, cols.len())
}

/// Layer normalisation over the last dimension (`weight`/`bias` as in PyTorch's `nn.LayerNorm`;
/// no bias for `bias=False`, as ModernBERT's).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub eps: f64,
}

impl<B: KilnBackend> LayerNorm<B> {
    pub fn new(d: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            bias: Some(Param::from_tensor(ops::owned(Tensor::zeros([d], device)))),
            ..Self::without_bias(d, eps, device)
        }
    }

    pub fn without_bias(d: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(ops::owned(Tensor::ones([d], device))),
            bias: None,
            eps,
        }
    }

    /// The bias, or zeros (a constant) where there is none.
    fn bias(&self) -> Tensor<B, 1> {
        match &self.bias {
            Some(b) => b.val(),
            None => Tensor::zeros(self.weight.dims(), &self.weight.device()),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        ops::layer_norm(x, self.weight.val(), self.bias(), self.eps)
    }

    /// `norm(dropout(x) + residual)`, fused (a transformer sub-layer's output).
    pub fn forward_residual<const D: usize>(
        &self,
        x: Tensor<B, D>,
        residual: Tensor<B, D>,
        dropout: f64,
    ) -> Tensor<B, D> {
        ops::residual_layer_norm(
            x,
            residual,
            self.weight.val(),
            self.bias(),
            self.eps,
            dropout,
        )
    }
}

/// A lookup table `[num_embeddings, dim]`.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: KilnBackend> Embedding<B> {
    /// A table of `n` rows of `d` drawn from N(0, std²), in a buffer of its own: a table made
    /// from data is a borrowed view that every `val()` copies whole (a 152K-token vocabulary's
    /// 545 MB, on each forward and each optimizer step).
    pub fn new(n: usize, d: usize, std: f64, device: &B::Device) -> Self {
        let weight = Tensor::random([n, d], Distribution::Normal(0.0, std), device);
        Self {
            weight: Param::from_tensor(ops::owned(weight)),
        }
    }

    /// `ids [B, T]` → `[B, T, dim]`.
    pub fn forward(&self, ids: Tensor<B, 2, burn::tensor::Int>) -> Tensor<B, 3> {
        let [b, t] = ids.dims();
        let d = self.weight.dims()[1];
        let rows = ops::embedding(self.weight.val(), ids.reshape([b * t]));
        ops::reshape(rows, [b, t, d])
    }
}

/// Root-mean-square normalisation over the last dimension (Llama's `LlamaRMSNorm`):
/// `x / sqrt(mean(x²) + eps) · weight`, no mean subtraction and no bias.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: KilnBackend> RmsNorm<B> {
    pub fn new(d: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(ops::owned(Tensor::ones([d], device))),
            eps,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        ops::rms_norm(x, self.weight.val(), self.eps)
    }
}

/// `cos`, `sin` tables `[T, head_dim]` for positions `start..start + T` (each frequency twice, as
/// transformers concatenates `freqs` with itself).
pub fn rope_tables<B: Backend>(
    inv_freq: &[f32],
    start: usize,
    len: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    rope_tables_at(inv_freq, start..start + len, device)
}

/// [`rope_tables`] for the positions of packed sequences: each of `segments` (lengths, laid end
/// to end) counts its positions from 0, as transformers' `position_ids` do under padding-free
/// packing.
pub fn packed_rope_tables<B: Backend>(
    inv_freq: &[f32],
    segments: &[usize],
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let positions: Vec<usize> = segments.iter().flat_map(|&n| 0..n).collect();
    rope_tables_at(inv_freq, positions.into_iter(), device)
}

/// `cos`, `sin` tables `[positions, head_dim]` for the given positions, in order.
fn rope_tables_at<B: Backend>(
    inv_freq: &[f32],
    positions: impl ExactSizeIterator<Item = usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let half = inv_freq.len();
    let len = positions.len();
    let (mut cos, mut sin) = (
        Vec::with_capacity(len * half * 2),
        Vec::with_capacity(len * half * 2),
    );
    for pos in positions {
        for _ in 0..2 {
            for &f in inv_freq {
                // f32 like PyTorch: position · inv_freq, then cos/sin.
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
    }
    let t =
        |v: Vec<f32>| Tensor::from_data(burn::tensor::TensorData::new(v, [len, half * 2]), device);
    (t(cos), t(sin))
}

/// Rotary inverse frequencies `1 / θ^(2i/d)`, `i < d/2` (transformers' default RoPE).
pub fn inv_freq(theta: f64, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32)
        .collect()
}

/// A tensor-parallel rank's cut of a parameter: detached copies of the given rows or columns.
pub(crate) fn slice_rows<B: KilnBackend>(
    p: Param<Tensor<B, 2>>,
    rows: Range<usize>,
) -> Param<Tensor<B, 2>> {
    let w = p.val();
    let cols = w.dims()[1];
    Param::from_tensor(crate::ops::owned(w.slice([rows, 0..cols])).detach())
}

fn slice_cols<B: KilnBackend>(p: Param<Tensor<B, 2>>, cols: Range<usize>) -> Param<Tensor<B, 2>> {
    let w = p.val();
    let rows = w.dims()[0];
    Param::from_tensor(crate::ops::owned(w.slice([0..rows, cols])).detach())
}

fn slice_vec<B: KilnBackend>(p: Param<Tensor<B, 1>>, r: Range<usize>) -> Param<Tensor<B, 1>> {
    Param::from_tensor(crate::ops::owned(p.val().slice([r])).detach())
}

impl<B: KilnBackend> Linear<B> {
    /// A column-parallel cut (Megatron's `ColumnParallelLinear`): output rows `rows`, and their
    /// bias.
    pub fn column_parallel(self, rows: Range<usize>, tp: TpComm) -> Self {
        Linear {
            weight: slice_rows(self.weight, rows.clone()),
            bias: self.bias.map(|b| slice_vec(b, rows.clone())),
            inference_weight: None,
            parallel: Ignored(Some(ParallelLinear::Column(tp))),
            lora_b: self.lora_b.map(|f| LoraFactor {
                weight: slice_rows(f.weight, rows),
            }),
            ..self
        }
    }

    /// A row-parallel cut (Megatron's `RowParallelLinear`) over the group `tp`: input columns
    /// `cols`; the bias stays whole, added once after the group's sum.
    pub fn row_parallel(self, cols: Range<usize>, tp: TpComm) -> Self {
        let full = self.weight.dims()[1];
        Linear {
            weight: slice_cols(self.weight, cols.clone()),
            inference_weight: None,
            parallel: Ignored(Some(ParallelLinear::Row {
                tp,
                cols: cols.clone(),
                full,
            })),
            lora_a: self.lora_a.map(|f| LoraFactor {
                weight: slice_cols(f.weight, cols),
            }),
            ..self
        }
    }

    /// The whole layer on every rank of `tp`, keeping output features `keep`
    /// ([`ParallelLinear::ReplicatedKeep`]).
    pub fn replicated_keep(self, keep: Range<usize>, tp: TpComm) -> Self {
        Linear {
            parallel: Ignored(Some(ParallelLinear::ReplicatedKeep { tp, keep })),
            ..self
        }
    }
}
