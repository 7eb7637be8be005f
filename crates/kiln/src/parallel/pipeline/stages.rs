//! Where a model is cut into pipeline stages: at decoder-layer boundaries, stage 0 holding the
//! embedding and the last stage the final norm and the head.
//!
//! The default cut counts the embedding and the head as one layer each (as torchtitan does), so
//! the first and last stages are not the heaviest, and spreads the rest as evenly as it goes:
//! every stage gets at least one decoder layer, then each further layer goes to the stage with the
//! least work so far (the earlier one on a tie). `--pipeline-cuts` gives the cut instead, as the
//! decoder-layer indices where stages 1, 2, … begin. Every layer lands on exactly one stage, in
//! order; an uneven cut is allowed, a layer is never dropped.
//!
//! `--pipeline-balance compute` weighs each part by its matrix multiply-adds per token instead
//! ([`Work`]): a large vocabulary's head (SmolLM2's is about eight layers' work) then gets a
//! stage with fewer layers. The cut found makes the heaviest stage as light as any cut can.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::{KilnError, Result};

/// What one pipeline stage holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageCut {
    /// The decoder layers `model.layers.{i}` it runs, in order.
    pub layers: Range<usize>,
    /// Whether it holds the token embedding (stage 0).
    pub embedding: bool,
    /// Whether it holds the final norm and the head, and computes the loss (the last stage).
    pub head: bool,
}

impl StageCut {
    /// The layers it counts as for balancing: its decoder layers, plus one each for the
    /// embedding and the head.
    pub fn weight(&self) -> usize {
        self.layers.len() + usize::from(self.embedding) + usize::from(self.head)
    }
}

/// The cut of a model of `layers` decoder layers into `stages` stages: `cuts` (the layer each
/// stage after the first begins at) when given, the balanced default otherwise. An error is one
/// sentence naming the option at fault.
pub fn cut_stages(layers: usize, stages: usize, cuts: Option<&[usize]>) -> Result<Vec<StageCut>> {
    if stages == 0 {
        return Err(KilnError::Config(
            "--pipeline-parallel-size must be at least 1".into(),
        ));
    }
    if layers < stages {
        return Err(KilnError::Config(format!(
            "--pipeline-parallel-size {stages} is more stages than the model's {layers} decoder \
             layers (each stage needs at least one)"
        )));
    }
    let starts = match cuts {
        Some(cuts) => checked_cuts(cuts, layers, stages)?,
        None => balanced_starts(layers, stages),
    };
    Ok((0..stages)
        .map(|s| StageCut {
            layers: starts[s]..starts.get(s + 1).copied().unwrap_or(layers),
            embedding: s == 0,
            head: s + 1 == stages,
        })
        .collect())
}

/// How the default cut weighs a stage's work (`--pipeline-balance`; `pipeline_balance` in argument
/// files, read and written as its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Balance {
    /// Each decoder layer, the embedding and the head count as one layer (torchtitan's rule).
    Layers,
    /// Each part counts its matrices' multiply-adds per token ([`Work`]).
    Compute,
}

impl Balance {
    /// `--pipeline-balance` as written.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "layers" => Ok(Self::Layers),
            "compute" => Ok(Self::Compute),
            _ => Err(KilnError::Config(format!(
                "--pipeline-balance {s:?} is not a balance (layers or compute)"
            ))),
        }
    }

    /// [`Self::parse`] as a flag's value parser (the error as text).
    pub fn from_flag(s: &str) -> std::result::Result<Self, String> {
        Self::parse(s).map_err(|e| e.to_string())
    }
}

impl std::fmt::Display for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Layers => "layers",
            Self::Compute => "compute",
        })
    }
}

impl TryFrom<String> for Balance {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        Self::from_flag(&s)
    }
}

impl From<Balance> for String {
    fn from(b: Balance) -> String {
        b.to_string()
    }
}

/// A decoder's work per token in multiply-adds, from its parameters' shapes: each layer's
/// matrices, and the head's (`lm_head`, or the tied embedding read as the head). Looking up the
/// embedding costs nothing beside them, and the attention scores (which grow with the sequence)
/// are left out.
#[derive(Debug, Clone, PartialEq)]
pub struct Work {
    pub layers: Vec<f64>,
    pub head: f64,
}

impl Work {
    /// The work of a model of `layers` decoder layers whose parameters have `shapes`;
    /// `embedding` names the embedding, which is the head too when `tied`.
    pub fn of_shapes(
        shapes: &BTreeMap<String, Vec<usize>>,
        layers: usize,
        embedding: &[String],
        tied: bool,
    ) -> Self {
        let mut work = Self {
            layers: vec![0.0; layers],
            head: 0.0,
        };
        for (path, shape) in shapes.iter().filter(|(_, s)| s.len() >= 2) {
            let n = shape.iter().product::<usize>() as f64;
            match layer_index(path) {
                Some(i) if i < layers => work.layers[i] += n,
                _ if path.ends_with("lm_head.weight") => work.head += n,
                _ if tied && embedding.iter().any(|e| e == path) => work.head += n,
                _ => {}
            }
        }
        work
    }
}

/// The cut of a model doing `work` into `stages` stages that makes the heaviest stage as light as
/// possible (the earliest such cut; stage 0 adds nothing for the embedding, the last stage adds
/// the head).
pub fn cut_by_work(work: &Work, stages: usize) -> Result<Vec<StageCut>> {
    let layers = work.layers.len();
    // The checks and the shape of the result are the layer rule's.
    let mut cut = cut_stages(layers, stages, None)?;
    let mut prefix = vec![0.0; layers + 1];
    for (i, w) in work.layers.iter().enumerate() {
        prefix[i + 1] = prefix[i] + w;
    }
    let stage_work = |j: usize, i: usize, s: usize| {
        prefix[i] - prefix[j] + if s + 1 == stages { work.head } else { 0.0 }
    };
    // best[s][i]: the lightest heaviest stage over stages 0..=s holding layers 0..i, and where
    // stage s begins in it.
    let mut best = vec![vec![(f64::INFINITY, 0usize); layers + 1]; stages];
    for (i, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = (stage_work(0, i, 0), 0);
    }
    for s in 1..stages {
        for i in s + 1..=layers {
            for j in s..i {
                let heaviest = best[s - 1][j].0.max(stage_work(j, i, s));
                if heaviest < best[s][i].0 {
                    best[s][i] = (heaviest, j);
                }
            }
        }
    }
    let mut end = layers;
    for s in (0..stages).rev() {
        let start = if s == 0 { 0 } else { best[s][end].1 };
        cut[s].layers = start..end;
        end = start;
    }
    Ok(cut)
}

/// The decoder layer a parameter `path` belongs to (`….layers.{i}.…`), if any.
pub fn layer_index(path: &str) -> Option<usize> {
    let parts: Vec<&str> = path.split('.').collect();
    parts
        .windows(2)
        .find(|w| w[0] == "layers")
        .and_then(|w| w[1].parse::<usize>().ok())
}

/// The stage that holds parameter `path` (a Hugging Face name): a decoder layer's
/// (`….layers.{i}.…`) stage, the embedding's (`embedding`) stage 0, anything else (the final norm,
/// the head) the last stage's.
pub fn owner_stage(path: &str, cuts: &[StageCut], embedding: &[String]) -> usize {
    match layer_index(path) {
        Some(i) => cuts
            .iter()
            .position(|c| c.layers.contains(&i))
            .unwrap_or(cuts.len() - 1),
        None if embedding.iter().any(|e| e == path) => 0,
        None => cuts.len() - 1,
    }
}

/// What one pipeline stage holds of a model cut at `cuts`: the parameters it builds, reads and
/// trains (its layers', the embedding on stage 0, the norm and head on the last; a tied embedding
/// on both), and the ones it owns (saves, and gives the others when the stages are gathered).
#[derive(Debug, Clone)]
pub struct StageHolds {
    pub index: usize,
    pub cuts: Vec<StageCut>,
    /// The embedding's parameters.
    pub embedding: Vec<String>,
    /// Whether the head is the embedding's weight (no parameter of its own).
    pub tied: bool,
}

impl StageHolds {
    /// Whether this stage runs with parameter `path`.
    pub fn holds(&self, path: &str) -> bool {
        self.owns(path)
            || (self.tied
                && self.index + 1 == self.cuts.len()
                && self.embedding.iter().any(|e| e == path))
    }

    /// Whether this stage owns `path` (a tied embedding is stage 0's).
    pub fn owns(&self, path: &str) -> bool {
        owner_stage(path, &self.cuts, &self.embedding) == self.index
    }
}

/// Where each stage begins under the default cut (`[0, …]`, one entry per stage).
fn balanced_starts(layers: usize, stages: usize) -> Vec<usize> {
    let mut counts = vec![1usize; stages];
    let extra = |s: usize| usize::from(s == 0) + usize::from(s + 1 == stages);
    for _ in stages..layers {
        let lightest = (0..stages)
            .min_by_key(|&s| (counts[s] + extra(s), s))
            .expect("at least one stage");
        counts[lightest] += 1;
    }
    counts
        .iter()
        .scan(0, |at, &n| {
            let start = *at;
            *at += n;
            Some(start)
        })
        .collect()
}

/// `cuts` checked against the model: `stages - 1` layer indices, rising, each inside the model and
/// leaving every stage at least one layer.
fn checked_cuts(cuts: &[usize], layers: usize, stages: usize) -> Result<Vec<usize>> {
    let list = cuts
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    if cuts.len() + 1 != stages {
        return Err(KilnError::Config(format!(
            "--pipeline-cuts {list} gives {} stages, but --pipeline-parallel-size is {stages} \
             (give the {} layer indices where stages 1 to {} begin)",
            cuts.len() + 1,
            stages - 1,
            stages - 1
        )));
    }
    let mut prev = 0;
    for &c in cuts {
        if c <= prev || c >= layers {
            return Err(KilnError::Config(format!(
                "--pipeline-cuts {list}: {c} does not leave every stage at least one of the \
                 model's {layers} decoder layers (give rising indices between 1 and {})",
                layers - 1
            )));
        }
        prev = c;
    }
    Ok(std::iter::once(0).chain(cuts.iter().copied()).collect())
}

/// `--pipeline-cuts` as written: comma-separated decoder-layer indices, either plain (`4,8`) or
/// as the layers' names (`model.layers.4,model.layers.8`, as NxD's `pipeline_cuts` lists them).
pub fn parse_cuts(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|part| {
            let p = part.trim();
            let index = p.strip_prefix("model.layers.").unwrap_or(p);
            index.parse().map_err(|_| {
                KilnError::Config(format!(
                    "--pipeline-cuts {s:?}: {p:?} is not a decoder-layer index (such as 4 or \
                     model.layers.4)"
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layer lands on exactly one stage, in order; stage 0 alone holds the embedding and
    /// the last stage alone the head; no stage is empty; and the default cut is as even as
    /// counting the embedding and head as layers allows.
    #[test]
    fn every_layer_lands_on_exactly_one_stage() {
        for layers in 1..=40 {
            for stages in 1..=layers.min(8) {
                let cut = cut_stages(layers, stages, None).unwrap();
                let what = format!("{layers} layers over {stages} stages: {cut:?}");
                assert_eq!(cut.len(), stages, "{what}");
                let order: Vec<usize> = cut.iter().flat_map(|c| c.layers.clone()).collect();
                assert_eq!(order, (0..layers).collect::<Vec<_>>(), "{what}");
                assert!(cut.iter().all(|c| !c.layers.is_empty()), "{what}");
                assert_eq!(cut.iter().filter(|c| c.embedding).count(), 1, "{what}");
                assert!(cut[0].embedding && cut[stages - 1].head, "{what}");
                assert_eq!(cut.iter().filter(|c| c.head).count(), 1, "{what}");
                // As even as it goes: no stage is more than one layer heavier than another.
                let weights: Vec<usize> = cut.iter().map(StageCut::weight).collect();
                let (lo, hi) = (weights.iter().min().unwrap(), weights.iter().max().unwrap());
                assert!(hi - lo <= 1, "{what}: weights {weights:?}");
            }
        }
    }

    #[test]
    fn default_cuts_count_the_embedding_and_head_as_layers() {
        let layers = |l, s| -> Vec<Range<usize>> {
            cut_stages(l, s, None)
                .unwrap()
                .into_iter()
                .map(|c| c.layers)
                .collect()
        };
        // SmolLM2-135M's 30 layers over 2 stages: 15 each (16 units each with embedding/head).
        assert_eq!(layers(30, 2), [0..15, 15..30]);
        // 5 over 2 (the uneven cut): 3 + 2, the first stage taking the tie.
        assert_eq!(layers(5, 2), [0..3, 3..5]);
        // 30 over 4: 32 units, 8 each: the middle stages take one layer more.
        assert_eq!(layers(30, 4), [0..7, 7..15, 15..23, 23..30]);
        // 4 over 4: one layer each.
        assert_eq!(layers(4, 4), [0..1, 1..2, 2..3, 3..4]);
        assert_eq!(layers(7, 1), vec![(0..7)]);
    }

    #[test]
    fn given_cuts_are_taken_and_bad_ones_are_one_sentence() {
        let cut = cut_stages(5, 2, Some(&[1])).unwrap();
        assert_eq!((cut[0].layers.clone(), cut[1].layers.clone()), (0..1, 1..5));
        let cut = cut_stages(8, 3, Some(&parse_cuts("model.layers.2, 6").unwrap())).unwrap();
        assert_eq!(
            cut.iter().map(|c| c.layers.clone()).collect::<Vec<_>>(),
            [0..2, 2..6, 6..8]
        );
        let err = |layers, stages, cuts: &[usize]| {
            cut_stages(layers, stages, Some(cuts))
                .unwrap_err()
                .to_string()
        };
        assert!(err(8, 3, &[4]).contains("gives 2 stages, but --pipeline-parallel-size is 3"));
        assert!(err(8, 3, &[4, 4]).contains("4 does not leave every stage"));
        assert!(err(8, 3, &[5, 2]).contains("2 does not leave every stage"));
        assert!(err(8, 2, &[0]).contains("between 1 and 7"));
        assert!(err(8, 2, &[8]).contains("8 does not leave"));
        let e = cut_stages(3, 4, None).unwrap_err().to_string();
        assert!(
            e.contains("more stages than the model's 3 decoder layers"),
            "{e}"
        );
        let e = parse_cuts("4,layers.x").unwrap_err().to_string();
        assert!(
            e.contains("\"layers.x\" is not a decoder-layer index"),
            "{e}"
        );
    }

    /// A decoder shaped like SmolLM2-135M (30 layers, hidden 576, MLP 1536, 3 of 9 heads for
    /// key/value, a tied 49152-token head).
    fn smollm2_shapes() -> BTreeMap<String, Vec<usize>> {
        let mut shapes = BTreeMap::new();
        shapes.insert("model.embed_tokens.weight".to_string(), vec![49152, 576]);
        shapes.insert("model.norm.weight".to_string(), vec![576]);
        for i in 0..30 {
            let l = format!("model.layers.{i}");
            for (name, shape) in [
                ("self_attn.q_proj.weight", vec![576, 576]),
                ("self_attn.k_proj.weight", vec![192, 576]),
                ("self_attn.v_proj.weight", vec![192, 576]),
                ("self_attn.o_proj.weight", vec![576, 576]),
                ("mlp.gate_proj.weight", vec![1536, 576]),
                ("mlp.up_proj.weight", vec![1536, 576]),
                ("mlp.down_proj.weight", vec![576, 1536]),
                ("input_layernorm.weight", vec![576]),
            ] {
                shapes.insert(format!("{l}.{name}"), shape);
            }
        }
        shapes
    }

    /// SmolLM2's head is eight layers' work: weighing it, two stages split at layer 19 (the cut
    /// BENCHMARKS.md measured by hand as halving the bubble's gap), not 15.
    #[test]
    fn compute_balance_weighs_the_head() {
        let emb = vec!["model.embed_tokens.weight".to_string()];
        let work = Work::of_shapes(&smollm2_shapes(), 30, &emb, true);
        assert_eq!(
            work.layers[7],
            (576.0 * 576.0) * 2.0 + 192.0 * 576.0 * 2.0 + 3.0 * 1536.0 * 576.0
        );
        assert_eq!(work.head, 49152.0 * 576.0);
        let layers = |stages| -> Vec<Range<usize>> {
            cut_by_work(&work, stages)
                .unwrap()
                .into_iter()
                .map(|c| c.layers)
                .collect()
        };
        assert_eq!(layers(2), [0..19, 19..30]);
        // Untied, the head is lm_head: the same work.
        let mut untied = smollm2_shapes();
        untied.insert("lm_head.weight".into(), vec![49152, 576]);
        assert_eq!(Work::of_shapes(&untied, 30, &emb, false), work);
        let e = cut_by_work(&work, 31).unwrap_err().to_string();
        assert!(
            e.contains("more stages than the model's 30 decoder layers"),
            "{e}"
        );
    }

    /// Against every possible cut of small models: no cut has a lighter heaviest stage, and every
    /// layer lands on exactly one stage.
    #[test]
    fn compute_balance_is_the_lightest_cut() {
        // Every cut of `layers` into `stages` non-empty runs, as the stages' starts.
        fn all_starts(layers: usize, stages: usize) -> Vec<Vec<usize>> {
            if stages == 1 {
                return vec![vec![0]];
            }
            let mut out = Vec::new();
            for last in stages - 1..layers {
                for mut s in all_starts(last, stages - 1) {
                    s.push(last);
                    out.push(s);
                }
            }
            out
        }
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % 10 + 1) as f64
        };
        for layers in 1..=8 {
            for stages in 1..=layers.min(4) {
                let work = Work {
                    layers: (0..layers).map(|_| next()).collect(),
                    head: next() * 2.0,
                };
                let heaviest = |starts: &[usize]| {
                    (0..stages)
                        .map(|s| {
                            let end = starts.get(s + 1).copied().unwrap_or(layers);
                            let w: f64 = work.layers[starts[s]..end].iter().sum();
                            w + if s + 1 == stages { work.head } else { 0.0 }
                        })
                        .fold(0.0, f64::max)
                };
                let cut = cut_by_work(&work, stages).unwrap();
                let order: Vec<usize> = cut.iter().flat_map(|c| c.layers.clone()).collect();
                assert_eq!(order, (0..layers).collect::<Vec<_>>());
                assert!(cut.iter().all(|c| !c.layers.is_empty()));
                let starts: Vec<usize> = cut.iter().map(|c| c.layers.start).collect();
                let best = all_starts(layers, stages)
                    .iter()
                    .map(|s| heaviest(s))
                    .fold(f64::INFINITY, f64::min);
                assert_eq!(heaviest(&starts), best, "{layers} over {stages}: {work:?}");
            }
        }
        assert!(Balance::parse("zb")
            .unwrap_err()
            .to_string()
            .contains("layers or compute"));
    }

    #[test]
    fn each_parameter_belongs_to_its_layers_stage() {
        let cuts = cut_stages(5, 2, Some(&[3])).unwrap();
        let emb = vec!["model.embed_tokens.weight".to_string()];
        let owner = |p: &str| owner_stage(p, &cuts, &emb);
        assert_eq!(owner("model.embed_tokens.weight"), 0);
        assert_eq!(owner("model.layers.2.mlp.up_proj.weight"), 0);
        assert_eq!(owner("model.layers.3.self_attn.q_proj.weight"), 1);
        assert_eq!(
            owner("base_model.model.model.layers.4.mlp.lora_A.weight"),
            1
        );
        assert_eq!(owner("model.norm.weight"), 1);
        assert_eq!(owner("lm_head.weight"), 1);
    }
}
