//! Tensor parallelism for Llama, split as Megatron and neuronx-distributed split it: q/k/v and
//! gate/up by output rows (column-parallel), o_proj and down_proj by input columns (row-parallel,
//! bias added once after the sum), the embedding and the output head by vocabulary rows
//! (vocab-parallel; the loss is `parallel::VocabParallelCrossEntropy`). Norms are replicated.
//! Parameters keep their Hugging Face names with this rank's shapes.
//!
//! Attention is split by key/value group, so each rank's query heads read only its own key/value
//! heads; uneven splits (SmolLM2: 9 query / 3 key-value heads at TP=2) get no padding heads. With
//! fewer key/value heads than ranks, every rank holds the whole (small) k/v projections and reads
//! the heads its query heads need; their gradient is summed over the group (each rank's part comes
//! from its own query heads), so the replicas stay equal.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::contract::ParamSplit;
use crate::models::llama::config::LlamaConfig;
use crate::ops::{chunk_range as chunk, TpComm, VocabSlice};
use crate::{KilnError, Result};

/// What one tensor-parallel rank holds of a Llama.
#[derive(Debug, Clone)]
pub struct LlamaShard {
    pub tp: TpComm,
    /// Rows of `embed_tokens` / `lm_head`.
    pub vocab: Range<usize>,
    pub vocab_size: usize,
    /// This rank's query heads, and the key/value heads they read.
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Whether k/v projections are whole on every rank (fewer key/value heads than ranks).
    pub kv_replicated: bool,
    /// Query heads per key/value head.
    pub group: usize,
    /// Rows of gate/up, columns of down.
    pub intermediate: Range<usize>,
    pub head_dim: usize,
    /// The whole model's sizes: query heads, key/value heads, MLP width.
    pub full_heads: (usize, usize),
    pub intermediate_size: usize,
}

impl LlamaShard {
    /// Rank `tp.rank()`'s part of a model of config `c`.
    pub fn new(c: &LlamaConfig, tp: TpComm) -> Result<Self> {
        let (n, r) = (tp.size(), tp.rank());
        let (nh, nkv) = (c.num_attention_heads, c.kv_heads());
        if n > nh {
            return Err(KilnError::Config(format!(
                "--tensor-parallel-size {n} is more than the model's {nh} attention heads; \
                 use at most {nh}"
            )));
        }
        if n > c.intermediate_size || n > c.vocab_size {
            return Err(KilnError::Config(format!(
                "--tensor-parallel-size {n} leaves a rank without MLP rows or vocabulary"
            )));
        }
        let group = nh / nkv;
        let (q_heads, kv_heads, kv_replicated) = if nkv >= n {
            let kv = chunk(nkv, n, r);
            (kv.start * group..kv.end * group, kv, false)
        } else {
            let q = chunk(nh, n, r);
            let kv = q.start / group..(q.end - 1) / group + 1;
            (q, kv, true)
        };
        Ok(Self {
            vocab: chunk(c.vocab_size, n, r),
            vocab_size: c.vocab_size,
            q_heads,
            kv_heads,
            kv_replicated,
            group,
            intermediate: chunk(c.intermediate_size, n, r),
            head_dim: c.head_size(),
            full_heads: (nh, nkv),
            intermediate_size: c.intermediate_size,
            tp,
        })
    }

    /// This rank's columns of the vocabulary (its rows of `embed_tokens` / `lm_head`).
    pub fn vocab_slice(&self) -> VocabSlice {
        VocabSlice {
            tp: self.tp.clone(),
            columns: self.vocab.clone(),
            vocab: self.vocab_size,
        }
    }

    /// For each local query head, the index of the key/value head it reads among those this rank
    /// uses (`kv_heads`).
    pub fn kv_of_q(&self) -> Vec<usize> {
        self.q_heads
            .clone()
            .map(|q| q / self.group - self.kv_heads.start)
            .collect()
    }

    pub(super) fn head_rows(&self, heads: &Range<usize>) -> Range<usize> {
        heads.start * self.head_dim..heads.end * self.head_dim
    }

    /// How parameter `name` (a Hugging Face name, or a LoRA factor's) is cut on this rank.
    pub fn split_of(&self, name: &str) -> ParamSplit {
        if let Some(split) = crate::models::lora::factor_split(name, |n| self.split_of(n)) {
            return split;
        }
        let rows = |range: Range<usize>, full: usize| ParamSplit::Sharded {
            axis: 0,
            range,
            full,
        };
        let cols = |range: Range<usize>, full: usize| ParamSplit::Sharded {
            axis: 1,
            range,
            full,
        };
        let hd = self.head_dim;
        let (q, kv) = (
            self.head_rows(&self.q_heads),
            self.head_rows(&self.kv_heads),
        );
        let (nq, nkv) = (self.full_heads.0 * hd, self.full_heads.1 * hd);
        let part = |suffix: &str| name.ends_with(suffix);
        if part("embed_tokens.weight") || name == "lm_head.weight" {
            rows(self.vocab.clone(), self.vocab_size)
        } else if part("q_proj.weight") || part("q_proj.bias") {
            rows(q, nq)
        } else if (part("k_proj.weight")
            || part("k_proj.bias")
            || part("v_proj.weight")
            || part("v_proj.bias"))
            && !self.kv_replicated
        {
            rows(kv, nkv)
        } else if part("o_proj.weight") {
            cols(q, nq)
        } else if part("gate_proj.weight")
            || part("gate_proj.bias")
            || part("up_proj.weight")
            || part("up_proj.bias")
        {
            rows(self.intermediate.clone(), self.intermediate_size)
        } else if part("down_proj.weight") {
            cols(self.intermediate.clone(), self.intermediate_size)
        } else {
            // Norms, row-parallel biases, replicated k/v projections.
            ParamSplit::Replicated
        }
    }
}

/// Rank `rank` of `size` for working out a layout only (resharding files): there is no group to
/// talk to, and a collective through it is a bug.
#[derive(Debug)]
struct LayoutOnly(usize, usize);

impl crate::ops::TpReduce for LayoutOnly {
    fn sum(&self, _: Vec<f32>) -> Vec<f32> {
        unreachable!("a layout-only rank runs no collective")
    }
    fn max(&self, _: Vec<f32>) -> Vec<f32> {
        unreachable!("a layout-only rank runs no collective")
    }
    fn rank(&self) -> usize {
        self.0
    }
    fn size(&self) -> usize {
        self.1
    }
}

/// Every rank's cut of the parameters `names` of a model of config `c` split over `n` ranks, as
/// training at `--tensor-parallel-size n` holds them. With `kv_heads_read`, replicated key/value
/// projections (fewer key/value heads than ranks) are cut to the heads each rank's queries read,
/// as NxD's fused `qkv_proj` holds them.
pub fn splits_for<'a>(
    c: &LlamaConfig,
    names: impl Iterator<Item = &'a str> + Clone,
    n: usize,
    kv_heads_read: bool,
) -> Result<Vec<BTreeMap<String, ParamSplit>>> {
    (0..n)
        .map(|r| {
            let shard = LlamaShard::new(c, std::sync::Arc::new(LayoutOnly(r, n)))?;
            let kv = shard.head_rows(&shard.kv_heads);
            let kv_full = shard.full_heads.1 * shard.head_dim;
            Ok(names
                .clone()
                .map(|name| {
                    let is_kv = name.contains(".k_proj.") || name.contains(".v_proj.");
                    let split = if kv_heads_read && shard.kv_replicated && is_kv {
                        ParamSplit::Sharded {
                            axis: 0,
                            range: kv.clone(),
                            full: kv_full,
                        }
                    } else {
                        shard.split_of(name)
                    };
                    (name.to_string(), split)
                })
                .collect())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fake(usize, usize);
    impl crate::ops::TpReduce for Fake {
        fn sum(&self, v: Vec<f32>) -> Vec<f32> {
            v
        }
        fn max(&self, v: Vec<f32>) -> Vec<f32> {
            v
        }
        fn rank(&self) -> usize {
            self.0
        }
        fn size(&self) -> usize {
            self.1
        }
    }

    fn config(heads: usize, kv: usize) -> LlamaConfig {
        serde_json::from_value(serde_json::json!({
            "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv}))
        .unwrap()
    }

    fn shard(c: &LlamaConfig, r: usize, n: usize) -> Result<LlamaShard> {
        LlamaShard::new(c, std::sync::Arc::new(Fake(r, n)))
    }

    #[test]
    fn heads_split_by_key_value_group_without_padding() {
        // SmolLM2-135M: 9 query / 3 key-value heads at TP = 2.
        let c = config(9, 3);
        let (a, b) = (shard(&c, 0, 2).unwrap(), shard(&c, 1, 2).unwrap());
        assert_eq!((a.q_heads.clone(), a.kv_heads.clone()), (0..6, 0..2));
        assert_eq!((b.q_heads.clone(), b.kv_heads.clone()), (6..9, 2..3));
        assert!(!a.kv_replicated);
        assert_eq!(b.kv_of_q(), vec![0, 0, 0]);
        // 3 key-value heads over 4 ranks: replicated, and rank 2's queries straddle two groups.
        let r2 = shard(&c, 2, 4).unwrap();
        assert!(r2.kv_replicated);
        assert_eq!((r2.q_heads.clone(), r2.kv_heads.clone()), (5..7, 1..3));
        assert_eq!(r2.kv_of_q(), vec![0, 1]);
        let e = shard(&c, 0, 10).unwrap_err().to_string();
        assert!(e.contains("more than the model's 9 attention heads"), "{e}");
    }
}
