//! Tensor-parallel Llama equals the whole model: at TP = 2 and 3 (ranks as threads of this process,
//! on the in-process engine), every rank's loss equals the single model's cross-entropy and every
//! rank's gradient equals its slice of the single model's gradient, on tiny configs that cover
//! uneven head splits, a vocabulary not divisible by TP, fewer key/value heads than ranks
//! (replicated), tied and untied heads, and biases (added once after the sum).

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::{Cpu, CpuDevice, CpuTrain};
use kiln::contract::{CrossEntropy, Loss, Model, IGNORE_INDEX};
use kiln::data::lm::{ChunkedLoss, TokenBatch};
use kiln::formats::safetensors::HostTensor;
use kiln::models::llama::config::LlamaConfig;
use kiln::models::llama::{LlamaForCausalLM, LlamaShard};
use kiln::models::params::{map_params, module_tensors};
use kiln::parallel::threads::ThreadComm;
use kiln::parallel::{TpGroup, VocabParallelCrossEntropy};
use kiln::tasks::causal_lm::ChunkedMean;
use kiln::train::optim::GradAccumulator;

fn config(heads: usize, kv: usize, vocab: usize, tied: bool, bias: bool) -> LlamaConfig {
    serde_json::from_value(serde_json::json!({
        "vocab_size": vocab, "hidden_size": heads * 4, "intermediate_size": 22,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": 4, "initializer_range": 0.3, "tie_word_embeddings": tied,
        "attention_bias": bias, "mlp_bias": bias}))
    .unwrap()
}

fn batch(vocab: usize) -> (TokenBatch, Vec<i64>) {
    let (b, s) = (2, 6);
    let ids: Vec<i64> = (0..b * s).map(|i| ((i * 7 + 3) % vocab) as i64).collect();
    let mut targets: Vec<i64> = ids.iter().map(|&i| (i * 5 + 1) % vocab as i64).collect();
    targets[3] = IGNORE_INDEX;
    targets[8] = IGNORE_INDEX;
    let batch = TokenBatch {
        ids,
        batch: b,
        seq: s,
        segments: Vec::new(),
        chunked_loss: None,
        scoring: None,
        carried: Default::default(),
        attended_tokens: None,
    };
    (batch, targets)
}

/// The model's gradients as a module of the same shape (so the shard plan can cut them too).
fn grad_module(
    m: &LlamaForCausalLM<CpuTrain>,
    grads: &<CpuTrain as AutodiffBackend>::Gradients,
) -> LlamaForCausalLM<Cpu> {
    let mut acc = GradAccumulator::<Cpu>::default();
    acc.accumulate::<CpuTrain, _>(m, grads);
    map_params(m.clone(), |info, v| {
        let shape = burn::tensor::TensorMetadata::shape(&v);
        let g = acc
            .grads
            .get(info.path)
            .unwrap_or_else(|| panic!("{} has no gradient", info.path));
        use burn::tensor::ops::FloatTensorOps;
        CpuTrain::from_inner(Cpu::float_reshape(
            g.clone().into_primitive().tensor(),
            shape,
        ))
    })
    .valid()
}

fn model(c: &LlamaConfig) -> LlamaForCausalLM<CpuTrain> {
    let d = CpuDevice::default();
    kiln::ops::with_seeded_rng::<CpuTrain, _>(&d, 7, || LlamaForCausalLM::new(c, &d))
}

fn targets_tensor(t: &[i64]) -> Tensor<CpuTrain, 1, Int> {
    Tensor::from_data(
        TensorData::new(t.to_vec(), [t.len()]),
        &CpuDevice::default(),
    )
}

fn max_diff(a: &HostTensor, b: &HostTensor) -> f32 {
    assert_eq!(a.shape, b.shape);
    a.data
        .iter()
        .zip(&b.data)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// One rank's loss, its gradients, and its slice of the whole model's gradients.
type RankResult = (
    f32,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
);

fn check(c: &LlamaConfig, what: &str) {
    let (batch, targets) = batch(c.vocab_size);
    let full = model(c);
    let loss = CrossEntropy.loss(full.logits(&batch), targets_tensor(&targets));
    let want_loss: f32 = loss.clone().into_scalar();
    let want_grads = grad_module(&full, &loss.backward());
    // The loss from the whole per-rank logits, and from the head a chunk of positions at a
    // time (12 positions in chunks of 4).
    let chunked = TokenBatch {
        chunked_loss: Some(Arc::new(ChunkedLoss {
            targets: targets.clone(),
            chunk: 5,
        })),
        ..batch.clone()
    };
    for (batch, what) in [
        (&batch, what.to_string()),
        (&chunked, format!("{what} chunked")),
    ] {
        check_ranks(c, &what, batch, &targets, want_loss, &want_grads);
    }
}

fn check_ranks(
    c: &LlamaConfig,
    what: &str,
    batch: &TokenBatch,
    targets: &[i64],
    want_loss: f32,
    want_grads: &LlamaForCausalLM<Cpu>,
) {
    for size in [2, 3] {
        let comms = ThreadComm::<Cpu>::group(size, &CpuDevice::default());
        let ranks: Vec<RankResult> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let want = want_grads.clone();
                    s.spawn(move || {
                        let tp = TpGroup::comm(Arc::new(comm));
                        let shard = LlamaShard::new(c, tp.clone()).unwrap();
                        let m = model(c).shard(shard.clone());
                        let out = m.logits(batch);
                        let loss = match batch.chunked_loss {
                            Some(_) => ChunkedMean.loss(out, targets_tensor(targets)),
                            None => VocabParallelCrossEntropy {
                                tp,
                                vocab: c.vocab_size,
                            }
                            .loss(out, targets_tensor(targets)),
                        };
                        let value: f32 = loss.clone().into_scalar();
                        let got = module_tensors(&grad_module(&m, &loss.backward()));
                        let want = module_tensors(&want.shard(shard));
                        (value, got, want)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (value, got, want)) in ranks.iter().enumerate() {
            assert!(
                (value - want_loss).abs() < 1e-5,
                "{what} tp={size} rank {r}: loss {value} vs {want_loss}"
            );
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{what}: parameter names"
            );
            for (name, g) in got {
                let err = max_diff(g, &want[name]);
                assert!(
                    err < 1e-5,
                    "{what} tp={size} rank {r}: {name} gradient off by {err}"
                );
            }
        }
    }
}

#[test]
fn uneven_heads_and_vocabulary_untied_with_biases() {
    // SmolLM2's 9 query / 3 key-value heads; 53 tokens split 27/26 and 18/18/17.
    check(&config(9, 3, 53, false, true), "9q/3kv untied+bias");
}

#[test]
fn fewer_key_value_heads_than_ranks_tied() {
    // One key/value head for 4 query heads: replicated at TP 2 and 3 (rank 1 of 3 straddles).
    check(&config(4, 1, 31, true, false), "4q/1kv tied");
    // 2 key/value heads: sharded at TP 2, replicated at TP 3 with queries straddling groups.
    check(&config(6, 2, 40, true, false), "6q/2kv tied");
}
