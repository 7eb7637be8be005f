//! `LlamaForCausalLM` (also Mistral and Qwen2, which differ only in a sliding attention window and
//! q/k/v biases), following transformers' `modeling_llama.py` with the same parameter names
//! (`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.mlp.{gate,up,
//! down}_proj`, `input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`):
//! RMSNorm, rotary position embeddings (rotate-half form), grouped-query attention with a causal
//! mask, a SwiGLU MLP, and a key/value cache for generation. Tied embeddings (`tie_word_embeddings`)
//! have no `lm_head` parameter: the output projection reuses `embed_tokens.weight`.
//! `parallel.rs` plans one rank's cut of a tensor-parallel group; [`LlamaForCausalLM::shard`] cuts.

use burn::module::{Ignored, Module};
use burn::tensor::activation::softmax;
use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

pub use super::parallel::LlamaShard;
use crate::contract::{Model, Segments, TensorParallelLayout, IGNORE_INDEX};
use crate::data::lm::TokenBatch;
use crate::models::completion_scores::{chunked_completion_scores, completion_scores};
use crate::models::layers::{packed_rope_tables, rope_tables, Embedding, Linear, RmsNorm};
use crate::models::llama::config::LlamaConfig;
use crate::ops::{self, tp_enter, tp_sum, KilnBackend, TpComm};

#[derive(Module, Debug)]
pub struct LlamaAttention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Positions a token attends to, itself included (Mistral's `sliding_window`); `None`: all.
    pub window: Option<usize>,
    /// Under tensor parallelism: the key/value head (of this rank's) each of this rank's query
    /// heads reads, when that is not simply `i / (heads / kv heads)`; `None` otherwise.
    pub kv_of_q: Ignored<Option<Vec<usize>>>,
}

#[derive(Module, Debug)]
pub struct LlamaMlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

#[derive(Module, Debug)]
pub struct LlamaDecoderLayer<B: Backend> {
    pub self_attn: LlamaAttention<B>,
    pub mlp: LlamaMlp<B>,
    pub input_layernorm: RmsNorm<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    /// The tensor-parallel group the attention and the MLP are cut over (`None`: whole). Each
    /// block's input enters it once, where its column-parallel projections share it.
    pub tp: Ignored<Option<TpComm>>,
}

#[derive(Module, Debug)]
pub struct LlamaModel<B: Backend> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<LlamaDecoderLayer<B>>,
    pub norm: RmsNorm<B>,
    /// Rotary inverse frequencies (head_dim / 2), the config's scaling applied.
    pub inv_freq: Ignored<Vec<f32>>,
    /// `pad_token_id`: transformers builds the table with it as `padding_idx`, whose row PyTorch
    /// never gives a gradient (an `<|im_end|>` that is also the pad token stays as loaded).
    pub padding_idx: Ignored<Option<usize>>,
}

#[derive(Module, Debug)]
pub struct LlamaForCausalLM<B: Backend> {
    pub model: LlamaModel<B>,
    /// `None` when the embeddings are tied, or when the model is a sequence classifier.
    pub lm_head: Option<Linear<B>>,
    /// A sequence classifier's head (`LlamaForSequenceClassification`'s `score`, `[labels, H]`, no
    /// bias; a reward model's has one label) in place of `lm_head`: each row is scored at its
    /// last position whose token is not the padding token ([`last_non_padding`]).
    pub score: Option<Linear<B>>,
    /// This rank's place in a tensor-parallel group (`None`: the whole model).
    pub shard: Ignored<Option<LlamaShard>>,
}

/// Keys and values of the positions seen so far, per layer (`[B, S, kv_heads, head_dim]`, after
/// RoPE), so each generated token attends to the past without recomputing it.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
}

impl<B: Backend> KvCache<B> {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
        }
    }
    /// Positions already cached (read from any layer that holds some: a pipeline stage's
    /// cache fills only its own layers, all to the same length).
    pub fn len(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .next()
            .map_or(0, |(k, _)| k.dims()[1])
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `[B, S, kv_heads, D]` → `[B, S, kv_heads·n, D]`, each key/value head serving `n` query heads
/// (transformers' `repeat_kv`: query head `i` reads key/value head `i / n`).
fn repeat_kv<B: Backend>(x: Tensor<B, 4>, n: usize) -> Tensor<B, 4> {
    if n == 1 {
        return x;
    }
    let [b, s, h, d] = x.dims();
    x.unsqueeze_dim::<5>(3)
        .expand([b, s, h, n, d])
        .reshape([b, s, h * n, d])
}

/// Additive causal mask `[T, S]` for queries at positions `past..past + T` over keys `0..S`, each
/// seeing at most `window` positions (itself included).
fn causal_mask<B: Backend>(
    t: usize,
    s: usize,
    window: Option<usize>,
    device: &B::Device,
) -> Tensor<B, 2> {
    let past = s - t;
    let w = window.unwrap_or(usize::MAX);
    let v: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..s).map(move |j| {
                if j <= past + i && past + i - j < w {
                    0.0
                } else {
                    f32::MIN
                }
            })
        })
        .collect();
    Tensor::from_data(TensorData::new(v, [t, s]), device)
}

impl<B: KilnBackend> LlamaAttention<B> {
    fn new(c: &LlamaConfig, layer: usize, device: &B::Device) -> Self {
        let (h, hd, std) = (c.hidden_size, c.head_size(), c.initializer_range);
        let (nh, nkv, qkv_bias) = (c.num_attention_heads, c.kv_heads(), c.qkv_bias());
        Self {
            q_proj: Linear::new(h, nh * hd, qkv_bias, std, device),
            k_proj: Linear::new(h, nkv * hd, qkv_bias, std, device),
            v_proj: Linear::new(h, nkv * hd, qkv_bias, std, device),
            o_proj: Linear::new(nh * hd, h, c.attention_bias, std, device),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            window: c.window(layer),
            kv_of_q: Ignored(None),
        }
    }

    /// `x [B, T, H]`. Without a cache, or filling an empty one (training, evaluation, a prompt),
    /// the fused causal attention kernel runs; decoding with cached keys composes Burn ops.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &(Tensor<B, 2>, Tensor<B, 2>),
        cache: Option<&mut Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
        segments: &[usize],
    ) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let heads = |y: Tensor<B, 3>, n: usize| y.reshape([b, t, n, hd]);
        let q = ops::rope(heads(self.q_proj.forward(x.clone()), nh), &rope.0, &rope.1);
        let (k, v) = (
            heads(self.k_proj.forward(x.clone()), nkv),
            heads(self.v_proj.forward(x), nkv),
        );
        let k = ops::rope(k, &rope.0, &rope.1);
        let (k, v) = match cache {
            None => (k, v),
            Some(slot) => {
                let past = slot.take();
                let fresh = past.is_none();
                let (k_all, v_all) = match past {
                    Some((pk, pv)) => (Tensor::cat(vec![pk, k], 1), Tensor::cat(vec![pv, v], 1)),
                    None => (k, v),
                };
                *slot = Some((k_all.clone(), v_all.clone()));
                if !fresh {
                    return self.o_proj.forward(self.attend_cached(q, k_all, v_all));
                }
                (k_all, v_all)
            }
        };
        // Grouped key/value heads go to the kernel as they are (query head i reads key/value head
        // i / (heads / kv heads)); a shard whose query heads start or end inside a group gets
        // one key/value head per query head.
        let flat = |y: Tensor<B, 4>| {
            let n = y.dims()[2];
            y.reshape([b, t, n * hd])
        };
        let (q, k, v) = (flat(q), flat(self.grouped_kv(k)), flat(self.grouped_kv(v)));
        let out = if segments.len() > 1 {
            // Padding-free packing: each sequence attends within itself only (the projections
            // above ran over all of them at once).
            let mut start = 0;
            let parts = segments
                .iter()
                .map(|&n| {
                    let part = |y: &Tensor<B, 3>| y.clone().narrow(1, start, n);
                    let out = self.attend(part(&q), part(&k), part(&v));
                    start += n;
                    out
                })
                .collect();
            Tensor::cat(parts, 1)
        } else {
            self.attend(q, k, v)
        };
        // o_proj is row-parallel under tensor parallelism: the ranks' heads are summed there.
        self.o_proj.forward(out)
    }

    /// Causal attention of one sequence per row (`[B, T, heads·D]` in and out), within the
    /// sliding window where the layer has one.
    fn attend(&self, q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>) -> Tensor<B, 3> {
        let nh = self.num_heads;
        match self.window {
            None => ops::causal_attention(q, k, v, nh),
            Some(w) => {
                let [b, t, _] = q.dims();
                let mask = Tensor::zeros([b, t], &q.device());
                let window = ops::Window {
                    before: w - 1,
                    after: 0,
                };
                ops::windowed_attention(q, k, v, mask, nh, window, 0.0)
            }
        }
    }

    /// Key/value heads `[B, S, kv, D]` for the attention kernel: as they are when query head `i`
    /// reads key/value head `i / (heads / kv)`, else [`Self::expand_kv`]'s one per query head.
    fn grouped_kv(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        match self.kv_of_q.0 {
            None => x,
            Some(_) => self.expand_kv(x),
        }
    }

    /// Key/value heads `[B, S, kv, D]` → one per query head `[B, S, heads, D]`.
    fn expand_kv(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let Some(map) = self.kv_of_q.0.as_ref() else {
            return repeat_kv(x, self.num_heads / self.num_kv_heads);
        };
        // A query range that starts or ends inside a group (replicated key/value heads).
        let idx = Tensor::<B, 1, burn::tensor::Int>::from_data(
            TensorData::new(
                map.iter().map(|&k| k as i64).collect::<Vec<_>>(),
                [map.len()],
            ),
            &x.device(),
        );
        x.select(2, idx)
    }

    /// Attention of `q [B, T, heads, D]` over all cached keys/values `[B, S, kv_heads, D]`
    /// (queries at positions `S − T..S`), composed of Burn ops; `[B, T, heads·D]` out.
    fn attend_cached(&self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, t, nh, hd] = q.dims();
        let s = k.dims()[1];
        let (q, k, v) = (
            q.swap_dims(1, 2),
            self.expand_kv(k).swap_dims(1, 2),
            self.expand_kv(v).swap_dims(1, 2),
        );
        let scores = ops::bmm(q, k.swap_dims(2, 3)).mul_scalar(1.0 / (hd as f64).sqrt());
        let mask = causal_mask::<B>(t, s, self.window, &scores.device()).unsqueeze::<4>();
        let probs = softmax(scores + mask, 3);
        ops::bmm(probs, v).swap_dims(1, 2).reshape([b, t, nh * hd])
    }
}

impl<B: KilnBackend> LlamaMlp<B> {
    fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        let (h, i, std) = (c.hidden_size, c.intermediate_size, c.initializer_range);
        Self {
            gate_proj: Linear::new(h, i, c.mlp_bias, std, device),
            up_proj: Linear::new(h, i, c.mlp_bias, std, device),
            down_proj: Linear::new(i, h, c.mlp_bias, std, device),
        }
    }

    /// `x` has entered the tensor-parallel group (if any): gate/up are column-parallel, down
    /// row-parallel.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gated = ops::swiglu(self.gate_proj.forward(x.clone()), self.up_proj.forward(x));
        self.down_proj.forward(gated)
    }
}

impl<B: KilnBackend> LlamaDecoderLayer<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &(Tensor<B, 2>, Tensor<B, 2>),
        cache: Option<&mut Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
        segments: &[usize],
    ) -> Tensor<B, 3> {
        let attn_in = self.enter(self.input_layernorm.forward(x.clone()));
        let h = x + self.self_attn.forward(attn_in, rope, cache, segments);
        let mlp_in = self.enter(self.post_attention_layernorm.forward(h.clone()));
        h + self.mlp.forward(mlp_in)
    }

    /// A block's input entering the tensor-parallel group (Megatron's
    /// `copy_to_tensor_model_parallel_region`: the same forward, its gradient summed over the
    /// group), once for the column-parallel projections that share it.
    fn enter(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.tp.0 {
            Some(tp) => tp_enter(x, tp),
            None => x,
        }
    }
}

impl<B: KilnBackend> LlamaForCausalLM<B> {
    /// A model with every weight freshly initialised the way transformers' `_init_weights` does:
    /// Linear and Embedding weights ~ N(0, initializer_range), biases 0, the padding row of the
    /// embedding 0, RMSNorm weights 1.
    pub fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        Self::new_sharded(c, device, None)
    }

    /// [`Self::new`] cut to tensor-parallel rank `shard` as it is built: each layer is made whole
    /// (from the same random stream, so the weights equal [`Self::new`]'s cut by [`Self::shard`])
    /// and cut at once, so a rank never holds more than its shard and one whole layer.
    pub fn new_sharded(c: &LlamaConfig, device: &B::Device, shard: Option<LlamaShard>) -> Self {
        Self::new_stage(c, device, shard, &crate::models::params::keep_all)
    }

    /// [`Self::new_sharded`] holding only the parameters `keep` accepts (a pipeline stage's):
    /// every layer is still drawn, so the random stream and the kept weights are the whole
    /// model's, but a layer `keep` refuses is let go as soon as it is drawn (see
    /// [`crate::models::params::empty_where`]).
    pub fn new_stage(
        c: &LlamaConfig,
        device: &B::Device,
        shard: Option<LlamaShard>,
        keep: crate::models::params::Keep,
    ) -> Self {
        use crate::models::params::empty_where;
        let (h, std) = (c.hidden_size, c.initializer_range);
        let mut embed = Embedding::new(c.vocab_size, h, std, device);
        let padding_idx = c
            .pad_token_id
            .map(|p| p as usize)
            .filter(|&p| p < c.vocab_size);
        if let Some(pad) = padding_idx {
            let w = embed.weight.val();
            // detach: an initial value is a leaf of the autodiff graph, not the result of an op
            let w = w.slice_assign([pad..pad + 1, 0..h], Tensor::zeros([1, h], device));
            embed.weight = burn::module::Param::from_tensor(ops::owned(w.detach()));
        }
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let layer = LlamaDecoderLayer {
                    self_attn: LlamaAttention::new(c, i, device),
                    mlp: LlamaMlp::new(c, device),
                    input_layernorm: RmsNorm::new(h, c.rms_norm_eps, device),
                    post_attention_layernorm: RmsNorm::new(h, c.rms_norm_eps, device),
                    tp: Ignored(None),
                };
                let layer = match &shard {
                    Some(s) => shard_layer(layer, s),
                    None => layer,
                };
                empty_where(layer, &format!("model.layers.{i}"), keep)
            })
            .collect();
        let model = Self {
            model: LlamaModel {
                embed_tokens: embed,
                layers,
                norm: RmsNorm::new(h, c.rms_norm_eps, device),
                inv_freq: Ignored(c.inv_freq()),
                padding_idx: Ignored(padding_idx),
            },
            lm_head: (!c.tie_word_embeddings && c.sequence_classifier_labels().is_none())
                .then(|| Linear::new(h, c.vocab_size, false, std, device)),
            score: c
                .sequence_classifier_labels()
                .map(|labels| Linear::new(h, labels, false, std, device)),
            shard: Ignored(None),
        };
        let mut model = match shard {
            // The layers are cut already; the embedding and head are cut now.
            Some(s) => model.shard_ends(s),
            None => model,
        };
        // The ends are let go after their cut (a cut of an empty tensor has no rows to take).
        model.model.embed_tokens =
            empty_where(model.model.embed_tokens, "model.embed_tokens", keep);
        model.model.norm = empty_where(model.model.norm, "model.norm", keep);
        model.lm_head = model.lm_head.map(|h| empty_where(h, "lm_head", keep));
        model.score = model.score.map(|h| empty_where(h, "score", keep));
        model
    }

    pub fn num_layers(&self) -> usize {
        self.model.layers.len()
    }

    /// Final hidden states `[B, T, H]` for `ids [B, T]`. With a cache, `ids` continue the cached
    /// positions and their keys/values are appended to it.
    pub fn hidden(
        &self,
        ids: Tensor<B, 2, Int>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let x = self.embed(ids);
        let layers = 0..self.model.layers.len();
        let x = match cache.as_mut() {
            Some(c) => self.decode_layers(x, layers, c),
            None => {
                let rope = rope_tables::<B>(&self.model.inv_freq, 0, x.dims()[1], &x.device());
                self.model
                    .layers
                    .iter()
                    .fold(x, |x, layer| layer.forward(x, &rope, None, &[]))
            }
        };
        self.model.norm.forward(x)
    }

    /// Hidden states `[1, T, H]` through decoder layers `layers` (a pipeline stage's, or all),
    /// continuing the positions `cache` holds and adding these.
    pub fn decode_layers(
        &self,
        mut x: Tensor<B, 3>,
        layers: std::ops::Range<usize>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let rope = rope_tables::<B>(&self.model.inv_freq, cache.len(), x.dims()[1], &x.device());
        for i in layers {
            x = self.model.layers[i].forward(x, &rope, Some(&mut cache.layers[i]), &[]);
        }
        x
    }

    /// The token embeddings `[1, T, H]` of one sequence's `ids` (decoding's first segment).
    pub fn embed_ids(&self, ids: &[i64]) -> Tensor<B, 3> {
        let device = self.model.embed_tokens.weight.device();
        let n = ids.len();
        self.embed(Tensor::from_data(
            TensorData::new(ids.to_vec(), [1, n]),
            &device,
        ))
    }

    /// The whole vocabulary's logits of the last position of the last layer's output `[1, T, H]`
    /// (decoding's last segment: final norm and head).
    pub fn last_logits(&self, x: Tensor<B, 3>) -> Vec<f32> {
        let h = self.model.norm.forward(x);
        let [_, n, hd] = h.dims();
        let last = h.slice([0..1, n - 1..n, 0..hd]).reshape([1, hd]);
        self.full_logits(self.project(last))
    }

    /// Token embeddings `[B, T, H]`; under tensor parallelism each rank looks up the ids in its
    /// vocabulary rows (zeros for the others) and the ranks' rows are summed.
    fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let padding = self.model.padding_idx.0.map(|p| {
            ids.clone()
                .equal_elem(p as i64)
                .float()
                .unsqueeze_dim::<3>(2)
        });
        let rows = match self.shard.as_ref() {
            None => self.model.embed_tokens.forward(ids),
            Some(s) => {
                let start = s.vocab.start as i64;
                let mine = ids
                    .clone()
                    .greater_equal_elem(start)
                    .bool_and(ids.clone().lower_elem(s.vocab.end as i64));
                let local = (ids - start).clamp(0, s.vocab.len() as i64 - 1);
                let rows =
                    self.model.embed_tokens.forward(local) * mine.float().unsqueeze_dim::<3>(2);
                tp_sum(rows, &s.tp)
            }
        };
        // The padding row's lookups pass on its value but no gradient.
        match padding {
            Some(pad) => rows.clone() * (pad.clone().neg() + 1.0) + rows.detach() * pad,
            None => rows,
        }
    }

    /// Vocabulary logits for hidden states `[…, H]` (under tensor parallelism: this rank's
    /// vocabulary columns; see [`Self::full_logits`]).
    pub fn project<const D: usize>(&self, h: Tensor<B, D>) -> Tensor<B, D> {
        let h = match self.shard.as_ref() {
            Some(s) => tp_enter(h, &s.tp),
            None => h,
        };
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => ops::linear(h, self.model.embed_tokens.weight.val(), None),
        }
    }

    /// The same model for inference only (prompt processing and decoding): every projection's
    /// weight moved to `[in, out]`, see [`Linear::into_inference_layout`]. A tied head keeps
    /// reading the embedding. A tensor-parallel shard stays as it is: its key/value path reads
    /// the `[out, in]` weights.
    pub fn into_inference_layout(mut self) -> Self {
        if self.shard.0.is_some() {
            return self;
        }
        self.model.layers = std::mem::take(&mut self.model.layers)
            .into_iter()
            .map(|mut l| {
                let a = l.self_attn;
                l.self_attn = LlamaAttention {
                    q_proj: a.q_proj.into_inference_layout(),
                    k_proj: a.k_proj.into_inference_layout(),
                    v_proj: a.v_proj.into_inference_layout(),
                    o_proj: a.o_proj.into_inference_layout(),
                    ..a
                };
                let m = l.mlp;
                l.mlp = LlamaMlp {
                    gate_proj: m.gate_proj.into_inference_layout(),
                    up_proj: m.up_proj.into_inference_layout(),
                    down_proj: m.down_proj.into_inference_layout(),
                };
                l
            })
            .collect();
        self.lm_head = self.lm_head.map(Linear::into_inference_layout);
        self.score = self.score.map(Linear::into_inference_layout);
        self
    }

    /// One decoding step for a single sequence: `ids` continue the cached positions (the whole
    /// prompt first, then one token at a time); returns the vocabulary logits of the last one.
    pub fn next_token_logits(&self, ids: &[i64], cache: &mut KvCache<B>) -> Vec<f32> {
        let layers = 0..self.model.layers.len();
        self.last_logits(self.decode_layers(self.embed_ids(ids), layers, cache))
    }

    /// Host logits over the whole vocabulary from [`Self::project`]'s rows: under tensor
    /// parallelism the ranks' slices are put together (for decoding, one row at a time).
    pub fn full_logits(&self, logits: Tensor<B, 2>) -> Vec<f32> {
        let host = |t: Tensor<B, 2>| {
            t.into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 logits")
        };
        let Some(s) = self.shard.as_ref() else {
            return host(logits);
        };
        let rows = logits.dims()[0];
        let local = host(logits);
        let mut full = vec![0f32; rows * s.vocab_size];
        for (r, part) in local.chunks(s.vocab.len()).enumerate() {
            full[r * s.vocab_size + s.vocab.start..r * s.vocab_size + s.vocab.end]
                .copy_from_slice(part);
        }
        s.tp.sum(full)
    }

    /// Logits `[B, T, vocab]`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>, cache: Option<&mut KvCache<B>>) -> Tensor<B, 3> {
        self.project(self.hidden(ids, cache))
    }
}

impl<B: KilnBackend> LlamaForCausalLM<B> {
    /// The RoPE tables of a training batch: positions `0..seq`, or from 0 in each packed
    /// sequence.
    fn batch_rope(&self, batch: &TokenBatch, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
        if batch.segments.len() > 1 {
            packed_rope_tables::<B>(&self.model.inv_freq, &batch.segments, device)
        } else {
            rope_tables::<B>(&self.model.inv_freq, 0, batch.seq, device)
        }
    }

    fn ids(&self, batch: &TokenBatch) -> Tensor<B, 2, Int> {
        let device = self.model.embed_tokens.weight.device();
        Tensor::from_data(
            TensorData::new(batch.ids.clone(), [batch.batch, batch.seq]),
            &device,
        )
    }
}

/// Embedding, decoder layers, final norm + projection: the segments activation checkpointing
/// recomputes one at a time (and pipeline stages would hold).
impl<B: KilnBackend> Segments<B, TokenBatch> for LlamaForCausalLM<B> {
    fn num_layers(&self) -> usize {
        self.model.layers.len()
    }

    fn embed(&self, batch: &TokenBatch) -> Tensor<B, 3> {
        LlamaForCausalLM::embed(self, self.ids(batch))
    }

    fn layer(&self, i: usize, x: Tensor<B, 3>, batch: &TokenBatch) -> Tensor<B, 3> {
        // The tables are small ([T, head_dim]); rebuilding them per layer keeps segments stateless.
        let rope = self.batch_rope(batch, &x.device());
        self.model.layers[i].forward(x, &rope, None, &batch.segments)
    }

    fn head(&self, h: Tensor<B, 3>, batch: &TokenBatch) -> Tensor<B, 2> {
        if let Some(score) = &self.score {
            return self.pooled_scores(score, h, batch);
        }
        let [b, t, hidden] = h.dims();
        let n = b * t;
        let chunk = match (&batch.chunked_loss, &batch.scoring) {
            (Some(loss), _) => loss.chunk,
            (None, Some(scoring)) => scoring.chunk,
            (None, None) => 0,
        };
        let weight = self.chunked_head_weight(n, chunk);
        let h = self.model.norm.forward(h).reshape([n, hidden]);
        // Under tensor parallelism the head's rows are this rank's columns of the vocabulary.
        let slice = self.shard.as_ref().map(LlamaShard::vocab_slice);
        match (&batch.chunked_loss, &batch.scoring, weight) {
            (Some(loss), _, weight) => self.chunked_losses(h, loss, weight, slice),
            (None, Some(scoring), Some(w)) => {
                chunked_completion_scores(h, w, b, scoring, &batch.carried, slice)
            }
            (None, Some(scoring), None) => {
                completion_scores(self.project(h), b, scoring, &batch.carried, slice)
            }
            (None, None, _) => self.project(h),
        }
    }
}

impl<B: KilnBackend> Model<B> for LlamaForCausalLM<B> {
    type Batch = TokenBatch;

    fn segments(&self) -> Option<&dyn Segments<B, TokenBatch>> {
        Some(self)
    }

    fn input_ids_numel(&self, batch: &TokenBatch) -> usize {
        batch.batch * batch.seq
    }

    fn attended_tokens(&self, batch: &TokenBatch) -> usize {
        batch
            .attended_tokens
            .unwrap_or_else(|| self.input_ids_numel(batch))
    }

    /// A causal LM's; a sequence classifier's loss is per sequence (transformers' Trainer
    /// averages its micro-batches' means).
    fn loss_over_step_tokens(&self) -> bool {
        self.score.is_none()
    }

    /// A tied head has no parameter of its own; an untied `lm_head` counts, as in transformers.
    fn embedding_parameters(&self) -> Vec<String> {
        vec![crate::models::decoder::DECODER_EMBEDDING.into()]
    }

    fn tensor_parallel(&self) -> Option<TensorParallelLayout> {
        let s = self.shard.as_ref()?;
        let splits = crate::models::params::module_shapes(self)
            .into_keys()
            .map(|name| {
                let split = s.split_of(&name);
                (name, split)
            })
            .collect();
        Some(TensorParallelLayout {
            tp: s.tp.clone(),
            splits,
        })
    }

    /// One row of vocabulary logits per token, `[batch·seq, vocab]`.
    /// The head's output for the batch ([`Segments::head`] of the last layer's output).
    fn logits(&self, batch: &TokenBatch) -> Tensor<B, 2> {
        let ids = self.ids(batch);
        let rope = self.batch_rope(batch, &ids.device());
        let x = self.model.layers.iter().fold(self.embed(ids), |x, layer| {
            layer.forward(x, &rope, None, &batch.segments)
        });
        Segments::head(self, x, batch)
    }
}

/// Where a sequence classifier reads each row's score: the last position whose token is not
/// `pad` (transformers' `GenericForSequenceClassification`: the attention mask is not read, so
/// right and left padding alike work, and a trailing EOS that is also the pad token is skipped);
/// 0 for a row of padding only; the last position when there is no padding token.
pub fn last_non_padding(row: &[i64], pad: Option<i64>) -> usize {
    match pad {
        Some(p) => row.iter().rposition(|&t| t != p).unwrap_or(0),
        None => row.len().saturating_sub(1),
    }
}

impl<B: KilnBackend> LlamaForCausalLM<B> {
    /// A sequence classifier's scores `[rows, labels]` (then the batch's carried values) from the
    /// last layer's output `x` `[rows, seq, H]`: each row's final-norm hidden state at
    /// [`last_non_padding`] through `score`. Only those positions are normed and projected:
    /// both act on each position alone, so this is transformers' score-everywhere-then-pick.
    fn pooled_scores(
        &self,
        score: &Linear<B>,
        x: Tensor<B, 3>,
        batch: &TokenBatch,
    ) -> Tensor<B, 2> {
        let [rows, seq, hidden] = x.dims();
        let pad = self.model.padding_idx.0.map(|p| p as i64);
        let at: Vec<i64> = batch
            .ids
            .chunks(seq.max(1))
            .enumerate()
            .map(|(r, row)| (r * seq + last_non_padding(row, pad)) as i64)
            .collect();
        let at = Tensor::<B, 1, Int>::from_data(TensorData::new(at, [rows]), &x.device());
        let picked = x.reshape([rows * seq, hidden]).select(0, at);
        let h = self.model.norm.forward(picked);
        crate::models::completion_scores::with_carried(vec![score.forward(h)], &batch.carried)
    }

    /// The output head's weight (this rank's rows of it under tensor parallelism) where `n`
    /// positions' logits are computed `chunk` at a time. A batch of at most two chunks'
    /// positions (or `chunk` 0), and a head that is not one plain product (a LoRA adapter on
    /// it, an inference layout), get their logits whole instead (`None`).
    fn chunked_head_weight(&self, n: usize, chunk: usize) -> Option<Tensor<B, 2>> {
        let plain =
            |l: &Linear<B>| l.lora_a.is_none() && l.inference_weight.is_none() && l.bias.is_none();
        match &self.lm_head {
            _ if chunk == 0 => None,
            // Two chunks' positions or fewer: the whole logits are small, and measured peaks
            // were no lower chunked (BENCHMARKS.md).
            _ if n <= 2 * chunk => None,
            Some(l) if plain(l) => Some(l.weight.val()),
            Some(_) => None,
            None => Some(self.model.embed_tokens.weight.val()),
        }
    }

    /// Each position's cross-entropy `[n, 1]` from the normed last hidden states `h` `[n, H]`:
    /// the output head's product and the loss a chunk of positions at a time
    /// ([`crate::ops::linear_cross_entropy`]) where `weight` is the head's
    /// ([`Self::chunked_head_weight`]), else from the whole logits.
    fn chunked_losses(
        &self,
        h: Tensor<B, 2>,
        loss: &crate::data::lm::ChunkedLoss,
        weight: Option<Tensor<B, 2>>,
        slice: Option<ops::VocabSlice>,
    ) -> Tensor<B, 2> {
        let n = h.dims()[0];
        assert_eq!(loss.targets.len(), n, "one target per position");
        let targets =
            Tensor::<B, 1, Int>::from_data(TensorData::new(loss.targets.clone(), [n]), &h.device());
        let losses = match weight {
            Some(w) => ops::linear_cross_entropy(h, w, targets, IGNORE_INDEX, loss.chunk, slice),
            None => ops::row_cross_entropy(self.project(h), targets, IGNORE_INDEX, slice.as_ref()),
        };
        losses.reshape([n, 1])
    }
}

// Cutting a whole model into this rank's shard (the plan is `parallel.rs`'s `LlamaShard`).
impl<B: KilnBackend> LlamaForCausalLM<B> {
    /// This rank's shard of the whole model `self`: every rank builds (or loads) the same full
    /// weights first, so TP = N starts from exactly the weights of TP = 1.
    pub fn shard(mut self, s: LlamaShard) -> Self {
        self.model.layers = self
            .model
            .layers
            .into_iter()
            .map(|l| shard_layer(l, &s))
            .collect();
        self.shard_ends(s)
    }

    /// The vocabulary-parallel ends (embedding, output head) cut, the shard recorded; the
    /// layers are the caller's.
    pub(super) fn shard_ends(mut self, s: LlamaShard) -> Self {
        self.model.embed_tokens.weight =
            crate::models::layers::slice_rows(self.model.embed_tokens.weight, s.vocab.clone());
        self.lm_head = self
            .lm_head
            .map(|h| h.column_parallel(s.vocab.clone(), s.tp.clone()));
        self.shard = Ignored(Some(s));
        self
    }
}

impl<B: Backend> crate::models::lora::LoraTarget<B> for LlamaForCausalLM<B> {
    fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        for (i, l) in self.model.layers.iter_mut().enumerate() {
            let a = &mut l.self_attn;
            let m = &mut l.mlp;
            for (name, layer) in [
                ("self_attn.q_proj", &mut a.q_proj),
                ("self_attn.k_proj", &mut a.k_proj),
                ("self_attn.v_proj", &mut a.v_proj),
                ("self_attn.o_proj", &mut a.o_proj),
                ("mlp.gate_proj", &mut m.gate_proj),
                ("mlp.up_proj", &mut m.up_proj),
                ("mlp.down_proj", &mut m.down_proj),
            ] {
                out.push((format!("model.layers.{i}.{name}"), layer));
            }
        }
        if let Some(h) = &mut self.lm_head {
            out.push(("lm_head".to_string(), h));
        }
        if let Some(h) = &mut self.score {
            out.push(("score".to_string(), h));
        }
        out
    }

    fn output_layers(&self) -> Vec<String> {
        vec!["lm_head".to_string(), "score".to_string()]
    }

    fn default_target_modules(&self) -> &'static [&'static str] {
        &["q_proj", "v_proj"]
    }

    fn tied_modules(&self) -> Vec<String> {
        match (&self.lm_head, &self.score) {
            (None, None) => vec!["model.embed_tokens".to_string(), "lm_head".to_string()],
            _ => Vec::new(),
        }
    }

    fn peft_task_type(&self) -> &'static str {
        match self.score {
            Some(_) => "SEQ_CLS",
            None => "CAUSAL_LM",
        }
    }

    /// PEFT's SEQ_CLS adds these to `modules_to_save` itself: the score head trains whole.
    fn task_modules_to_save(&self) -> Vec<String> {
        match self.score {
            Some(_) => vec!["classifier".to_string(), "score".to_string()],
            None => Vec::new(),
        }
    }

    fn split_of(&self, path: &str) -> crate::contract::ParamSplit {
        self.shard
            .as_ref()
            .map_or(crate::contract::ParamSplit::Replicated, |s| {
                s.split_of(path)
            })
    }
}

/// This rank's shard of one decoder layer.
fn shard_layer<B: KilnBackend>(
    mut layer: LlamaDecoderLayer<B>,
    s: &LlamaShard,
) -> LlamaDecoderLayer<B> {
    let q_rows = s.head_rows(&s.q_heads);
    let kv_rows = s.head_rows(&s.kv_heads);
    let a = &mut layer.self_attn;
    a.q_proj = a
        .q_proj
        .clone()
        .column_parallel(q_rows.clone(), s.tp.clone());
    if s.kv_replicated {
        // Whole k/v projections on every rank: all heads computed, the ones this rank's queries
        // read kept.
        a.k_proj = a
            .k_proj
            .clone()
            .replicated_keep(kv_rows.clone(), s.tp.clone());
        a.v_proj = a.v_proj.clone().replicated_keep(kv_rows, s.tp.clone());
    } else {
        a.k_proj = a
            .k_proj
            .clone()
            .column_parallel(kv_rows.clone(), s.tp.clone());
        a.v_proj = a.v_proj.clone().column_parallel(kv_rows, s.tp.clone());
    }
    a.o_proj = a.o_proj.clone().row_parallel(q_rows, s.tp.clone());
    a.num_heads = s.q_heads.len();
    a.num_kv_heads = s.kv_heads.len();
    // A query range that starts or ends inside a key/value group reads its heads by a map.
    let map = s.kv_of_q();
    let n = (a.num_heads / a.num_kv_heads.max(1)).max(1);
    let grouped =
        n * a.num_kv_heads == a.num_heads && map.iter().enumerate().all(|(i, &k)| k == i / n);
    a.kv_of_q = Ignored((!grouped).then_some(map));
    let m = &mut layer.mlp;
    m.gate_proj = m
        .gate_proj
        .clone()
        .column_parallel(s.intermediate.clone(), s.tp.clone());
    m.up_proj = m
        .up_proj
        .clone()
        .column_parallel(s.intermediate.clone(), s.tp.clone());
    m.down_proj = m
        .down_proj
        .clone()
        .row_parallel(s.intermediate.clone(), s.tp.clone());
    layer.tp = Ignored(Some(s.tp.clone()));
    layer
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuDevice};

    fn tiny() -> LlamaConfig {
        serde_json::from_value(serde_json::json!({
            "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 3,
            "initializer_range": 0.5, "tie_word_embeddings": true}))
        .unwrap()
    }

    fn host<const D: usize>(t: Tensor<Cpu, D>) -> Vec<f32> {
        t.into_data().into_vec().unwrap()
    }

    #[test]
    fn initialisation_follows_transformers() {
        let c = tiny();
        let d = CpuDevice::default();
        let m =
            crate::ops::with_seeded_rng::<Cpu, _>(&d, 1, || LlamaForCausalLM::<Cpu>::new(&c, &d));
        assert!(m.lm_head.is_none(), "tied");
        let e = host(m.model.embed_tokens.weight.val());
        assert!(
            e[3 * 32..4 * 32].iter().all(|&x| x == 0.0),
            "padding row is zero"
        );
        let w = host(m.model.layers[0].mlp.up_proj.weight.val());
        let std = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
        assert!((std - 0.5).abs() < 0.05, "std {std}");
        assert!(host(m.model.norm.weight.val()).iter().all(|&x| x == 1.0));
    }

    /// Every weight of a model built from a config holds a buffer of its own: Burn's ndarray
    /// backend keeps a tensor made from data (`Tensor::random`) as a borrowed view and copies it
    /// whole on every use, so two uses of a weight would see two buffers (the tied embedding was
    /// copied on each forward and each optimizer step). With and without a padding row (whose
    /// zeroing rebuilds the table).
    #[test]
    fn a_fresh_models_weights_are_not_copied_on_use() {
        use crate::models::params::map_params;
        let d = CpuDevice::default();
        let addr = |t: &burn::tensor::ops::FloatTensor<Cpu>| match t {
            burn::backend::ndarray::NdArrayTensor::F32(s) => s.view().as_ptr() as usize,
            _ => unreachable!("f32 weights"),
        };
        let mut untied = tiny();
        untied.pad_token_id = None;
        untied.tie_word_embeddings = false;
        for c in [tiny(), untied] {
            let m = crate::ops::with_seeded_rng::<Cpu, _>(&d, 1, || {
                LlamaForCausalLM::<Cpu>::new(&c, &d)
            });
            let mut seen = 0;
            let _ = map_params(m, |info, t| {
                let (a, b) = (t.clone(), t.clone());
                assert_eq!(addr(&a), addr(&b), "{} is copied on every use", info.path);
                seen += 1;
                t
            });
            assert!(seen > 10, "{seen} weights");
        }
    }

    /// A stage's model holds exactly what `keep` accepts, each weight equal to the whole
    /// model's of the same seed (every layer is still drawn), and nothing else; loading a folder
    /// for that stage reads only its tensors.
    #[test]
    fn a_stage_builds_and_loads_only_its_parameters() {
        use crate::models::params::{module_shapes, module_tensors};
        let c = tiny();
        let d = CpuDevice::default();
        let whole =
            crate::ops::with_seeded_rng::<Cpu, _>(&d, 4, || LlamaForCausalLM::<Cpu>::new(&c, &d));
        let whole = module_tensors(&whole);
        // The last stage of two: layer 1, the norm and the (tied) embedding.
        let keep = |p: &str| !p.starts_with("model.layers.0.");
        let stage = crate::ops::with_seeded_rng::<Cpu, _>(&d, 4, || {
            LlamaForCausalLM::<Cpu>::new_stage(&c, &d, None, &keep)
        });
        let check = |stage: &LlamaForCausalLM<Cpu>| {
            let shapes = module_shapes(stage);
            assert_eq!(shapes.len(), whole.len());
            for (path, t) in module_tensors(stage) {
                match keep(&path) {
                    true => assert_eq!(t.data, whole[&path].data, "{path}"),
                    false => assert_eq!(shapes[&path][0], 0, "{path} is held"),
                }
            }
        };
        check(&stage);
        // A folder of the whole model, its layer-0 tensors made unreadable (a wrong dtype):
        // the stage never reads them; the whole model does, and fails.
        let dir = tempfile::tempdir().unwrap();
        let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
        let bytes: Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)> = whole
            .iter()
            .map(|(p, t)| match keep(p) {
                true => (
                    p.clone(),
                    t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    t.shape.clone(),
                    safetensors::Dtype::F32,
                ),
                false => (p.clone(), vec![0; 1], vec![1], safetensors::Dtype::F8_E4M3),
            })
            .collect();
        for (p, b, shape, dtype) in &bytes {
            tensors.push((
                p.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), b).unwrap(),
            ));
        }
        safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors"))
            .unwrap();
        let loaded =
            super::super::load::load_shard_of::<Cpu>(dir.path(), &c, &d, None, &keep).unwrap();
        check(&loaded);
        let all = &crate::models::params::keep_all;
        let err = match super::super::load::load_shard_of::<Cpu>(dir.path(), &c, &d, None, all) {
            Ok(_) => panic!("the whole model reads layer 0"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("model.layers.0."), "{err}");
    }

    /// Decoding token by token with the cache gives the logits of one forward over the whole
    /// sequence (causal mask, RoPE offsets and grouped heads all line up).
    #[test]
    fn kv_cache_matches_full_forward() {
        let c = tiny();
        let d = CpuDevice::default();
        let m =
            crate::ops::with_seeded_rng::<Cpu, _>(&d, 2, || LlamaForCausalLM::<Cpu>::new(&c, &d));
        let ids: Vec<i64> = vec![5, 9, 1, 44, 17, 8, 30];
        let n = ids.len();
        let t = |v: &[i64]| {
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(v.to_vec(), [1, v.len()]), &d)
        };
        let full = host(m.forward(t(&ids), None));
        let mut cache = KvCache::new(c.num_hidden_layers);
        let mut stepped = host(m.forward(t(&ids[..3]), Some(&mut cache)));
        for i in 3..n {
            stepped.extend(host(m.forward(t(&ids[i..i + 1]), Some(&mut cache))));
        }
        assert_eq!(cache.len(), n);
        let err = full
            .iter()
            .zip(&stepped)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-4, "max |Δ| {err}");
        // and the future does not leak into the past: a changed last token leaves earlier rows alone
        let mut other = ids.clone();
        other[n - 1] = 2;
        let alt = host(m.forward(t(&other), None));
        let v = c.vocab_size;
        assert_eq!(alt[..(n - 1) * v], full[..(n - 1) * v]);
        assert_ne!(alt[(n - 1) * v..], full[(n - 1) * v..]);
    }

    /// The inference layout (weights `[in, out]`) gives the logits of the trained layout: a
    /// 7-token forward (the GEMM path), then decoding one token at a time (the few-rows path),
    /// with biases and an untied head; its `[out, in]` parameters are left empty.
    #[test]
    fn inference_layout_gives_the_same_logits() {
        let mut c = tiny();
        c.tie_word_embeddings = false;
        c.attention_bias = true;
        c.mlp_bias = true;
        c.intermediate_size = 50; // down_proj reads 50 rows: bands of 16 and a remainder of 2
        let d = CpuDevice::default();
        let m =
            crate::ops::with_seeded_rng::<Cpu, _>(&d, 3, || LlamaForCausalLM::<Cpu>::new(&c, &d));
        let fast = m.clone().into_inference_layout();
        let down = &fast.model.layers[1].mlp.down_proj;
        assert_eq!(down.weight.dims(), [0, 50]);
        assert_eq!(
            down.inference_weight.as_ref().map(|w| w.dims()),
            Some([50, 32])
        );
        assert!(fast.lm_head.as_ref().unwrap().inference_weight.is_some());
        let ids: Vec<i64> = vec![5, 9, 1, 44, 17, 8, 30];
        let t = |v: &[i64]| {
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(v.to_vec(), [1, v.len()]), &d)
        };
        let close = |a: Vec<f32>, b: Vec<f32>, what: &str| {
            assert_eq!(a.len(), b.len());
            let err = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-4, "{what}: max |Δ| {err}");
        };
        close(
            host(fast.forward(t(&ids), None)),
            host(m.forward(t(&ids), None)),
            "forward",
        );
        let (mut ca, mut cb) = (KvCache::new(2), KvCache::new(2));
        close(
            fast.next_token_logits(&ids[..4], &mut ca),
            m.next_token_logits(&ids[..4], &mut cb),
            "prompt",
        );
        for i in 4..ids.len() {
            close(
                fast.next_token_logits(&ids[i..i + 1], &mut ca),
                m.next_token_logits(&ids[i..i + 1], &mut cb),
                "decoding",
            );
        }
    }
}
