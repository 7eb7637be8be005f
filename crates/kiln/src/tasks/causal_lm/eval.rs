//! `kiln eval --task causal-lm`: loss and perplexity of a model folder on a held-out corpus, the
//! model spread over the processes started together as an [`InferenceLayout`] says (tensor
//! parallel, pipeline stages), each stage's share of an evaluation, and the metrics handed to
//! the first stage to report.

use std::path::Path;

use burn::tensor::{Tensor, TensorData};

use crate::data::lm::TokenBatch;
use crate::error::{KilnError, Result};
use crate::models::auto::with_causal_lm;
use crate::models::decoder::{DecoderArchitecture, DecoderConfig, DecoderFamily, DecoderVisitor};
use crate::ops::KilnBackend;
use crate::parallel::DataParallel;
use crate::train::evaluate::evaluate_by;
use crate::train::trainer::{evaluate, EvalOutput, Reported};
use crate::train::ModelOutline;

use super::*;

/// How `kiln eval` and `kiln generate` spread a model over the processes started together: its
/// tensor-parallel size, and its pipeline stages with their cut (as training cuts them).
#[derive(Debug, Clone)]
pub struct InferenceLayout {
    pub tensor_parallel_size: usize,
    pub pipeline_parallel_size: usize,
    /// `--pipeline-cuts`: where stages 1, 2, … begin (`None`: the default cut).
    pub pipeline_cuts: Option<Vec<usize>>,
}

impl InferenceLayout {
    /// The layout the command line asks for: `--pipeline-cuts` as written (`4,8`); a size of 0 is
    /// one sentence (not read as 1).
    pub fn from_args(
        tensor_parallel_size: usize,
        pipeline_parallel_size: usize,
        pipeline_cuts: Option<&str>,
    ) -> Result<Self> {
        for (flag, n) in [
            ("--tensor-parallel-size", tensor_parallel_size),
            ("--pipeline-parallel-size", pipeline_parallel_size),
        ] {
            if n == 0 {
                return Err(KilnError::Config(format!(
                    "{flag} 0: a model is cut over at least 1 process"
                )));
            }
        }
        Ok(Self {
            tensor_parallel_size,
            pipeline_parallel_size,
            pipeline_cuts: pipeline_cuts
                .map(crate::parallel::pipeline::parse_cuts)
                .transpose()?,
        })
    }
}

/// Loss and perplexity of a model folder on a held-out corpus (every rank's own result).
pub fn eval<B: KilnBackend>(
    opts: &CausalLmOptions,
    batch_size: usize,
    tensor_parallel_size: usize,
    device: &B::Device,
) -> Result<EvalOutput> {
    let layout = InferenceLayout {
        tensor_parallel_size,
        pipeline_parallel_size: 1,
        pipeline_cuts: None,
    };
    Ok(eval_layout::<B>(opts, batch_size, &layout, device)?.0)
}

/// [`eval`] at `layout`; also says whether this rank reports the result: the world's first rank
/// (under a pipeline the last stage computes it and hands it to the first).
pub fn eval_layout<B: KilnBackend>(
    opts: &CausalLmOptions,
    batch_size: usize,
    layout: &InferenceLayout,
    device: &B::Device,
) -> Result<(EvalOutput, bool)> {
    let dir = opts
        .model_dir
        .as_ref()
        .ok_or_else(|| KilnError::Config("kiln eval needs --model".into()))?;
    struct Run<'a, B: KilnBackend>(
        &'a CausalLmOptions,
        &'a Path,
        usize,
        &'a InferenceLayout,
        &'a B::Device,
    );
    impl<B: KilnBackend> DecoderVisitor for Run<'_, B> {
        type Output = Result<(EvalOutput, bool)>;
        fn visit<A: DecoderArchitecture>(
            self,
            family: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            let Run(opts, dir, batch_size, layout, device) = self;
            let tok_path = opts.tokenizer_path()?;
            let tok = load_tokenizer(&tok_path)?;
            let config = head_for_task(family, opts, config, &tok)?;
            let (tp, pp) = (layout.tensor_parallel_size, layout.pipeline_parallel_size);
            let (parallel, tp_group, pp_group) = DataParallel::<B>::join_mesh_pp(device, tp, pp)?;
            let tp_rank = tp_group.as_ref().map_or(0, |g| g.rank());
            let (shard, loss) = tensor_parallel_plan::<A, _>(&config, tp_group)?;
            let keep = inference_keep(&config, pp_group.as_deref(), layout)?;
            let model = A::load(dir, &config, device, shard, &keep)?;
            crate::data::tokenize::check_ids_fit(&tok, &tok_path, config.vocab_size())?;
            warn_beyond_positions(&config, opts.block_size, "--block-size");
            let file = opts
                .eval_file
                .as_ref()
                .ok_or_else(|| KilnError::Config("kiln eval needs --eval-file".into()))?;
            let place = EvalPlace {
                parallel: &parallel,
                stage: match &pp_group {
                    Some(group) => Some(eval_stage(&model, group.as_ref(), layout)?),
                    None => None,
                },
                first_rank: parallel.is_main() && tp_rank == 0,
                batch_size,
                device,
            };
            if let Some(reward) = &opts.reward {
                let eos = eos_id(&config, &tok);
                let set = reward_set(opts, reward, &tok, eos, file, opts.max_eval_samples)?;
                let metrics = reward.metrics();
                let r = Reported {
                    token_metrics: Some(metrics.as_ref()),
                    no_perplexity: true,
                    ..Reported::default()
                };
                return place.evaluate(&model, &set, &reward.loss(), r);
            }
            let set = opts.blocks(file, &tok, eos_id(&config, &tok), opts.max_eval_samples)?;
            let (mut out, reports) = place.evaluate(&model, &set, &loss, Reported::default())?;
            out.metrics.insert(
                "eval_tokens".into(),
                (set.len() * (set.block_size - 1)) as f64,
            );
            Ok((out, reports))
        }
    }
    let run = Run::<B>(opts, dir, batch_size, layout, device);
    with_causal_lm(&dir.join("config.json"), run)?
}

/// Where an evaluation runs: this rank's data-parallel group and pipeline stage (if any), and
/// whether it is the first rank of its tensor-parallel group and data-parallel replicas.
struct EvalPlace<'a, B: KilnBackend> {
    parallel: &'a DataParallel<B>,
    stage: Option<EvalStage<'a, B>>,
    first_rank: bool,
    batch_size: usize,
    device: &'a B::Device,
}

impl<B: KilnBackend> EvalPlace<'_, B> {
    /// `model` on `set`, and whether this rank reports the result: the world's first rank
    /// (under a pipeline the last stage computes it and hands it to the first).
    fn evaluate<M, E, L>(
        &self,
        model: &M,
        set: &E,
        loss: &L,
        reported: Reported<'_>,
    ) -> Result<(EvalOutput, bool)>
    where
        M: crate::contract::Model<B, Batch = TokenBatch>,
        E: crate::contract::BatchSource<Batch = TokenBatch>,
        L: crate::contract::Loss,
    {
        let (parallel, size) = (self.parallel, self.batch_size);
        let Some(stage) = &self.stage else {
            let out = evaluate(model, set, size, loss, reported, parallel)?;
            return Ok((out, self.first_rank));
        };
        let logits = |batch: &TokenBatch| stage.logits(batch);
        let mut out = evaluate_by(logits, self.device, set, size, loss, reported, parallel)?;
        // The result is reported by the first stage, where a launcher shows it.
        stage.metrics_to_first_stage(&mut out, self.device)?;
        Ok((out, stage.stage.index == 0 && self.first_rank))
    }
}

/// One pipeline stage of an evaluation: its model's segments, and the stage.
pub(super) struct EvalStage<'a, B: KilnBackend> {
    pub(super) segments: &'a dyn crate::contract::Segments<B, TokenBatch>,
    pub(super) stage: crate::train::pipeline::Stage<'a, B>,
}

/// What this rank of an inference pipeline over `group` builds and reads of a model of `config`
/// (every parameter without a pipeline): its stage's parameters, the stages cut as
/// [`eval_stage`] cuts them.
pub(super) fn inference_keep<B: KilnBackend>(
    config: &impl DecoderConfig,
    group: Option<&dyn crate::parallel::Collectives<B>>,
    layout: &InferenceLayout,
) -> Result<impl Fn(&str) -> bool + Sync> {
    let stage = match group {
        None => None,
        Some(g) => {
            let outline = decoder_outline(config);
            Some(crate::parallel::pipeline::StageHolds {
                index: g.rank(),
                cuts: crate::parallel::pipeline::cut_stages(
                    config.num_layers(),
                    g.size(),
                    layout.pipeline_cuts.as_deref(),
                )?,
                embedding: outline.embedding,
                tied: outline.tied,
            })
        }
    };
    Ok(move |path: &str| stage.as_ref().is_none_or(|s| s.holds(path)))
}

/// What a pipeline cuts a decoder of `config` by, worked out without building it: its layers,
/// every parameter's whole shape, the embedding (and whether the head is tied to it).
pub(super) fn decoder_outline(config: &impl DecoderConfig) -> ModelOutline {
    ModelOutline::new(
        Some(config.num_layers()),
        config.param_shapes(),
        vec![crate::models::decoder::DECODER_EMBEDDING.to_string()],
    )
}

/// This rank's stage of `model` cut over the pipeline `group` as `layout` says.
pub(super) fn eval_stage<'a, B: KilnBackend, M: crate::contract::Model<B, Batch = TokenBatch>>(
    model: &'a M,
    group: &'a dyn crate::parallel::Collectives<B>,
    layout: &InferenceLayout,
) -> Result<EvalStage<'a, B>> {
    let segments = model.segments().ok_or_else(|| {
        KilnError::Config(
            "--pipeline-parallel-size cuts a model at its decoder layers, and this model is not \
             split into layers"
                .into(),
        )
    })?;
    let cuts = crate::parallel::pipeline::cut_stages(
        segments.num_layers(),
        group.size(),
        layout.pipeline_cuts.as_deref(),
    )?;
    let stage = crate::train::pipeline::Stage {
        cut: cuts[group.rank()].clone(),
        group,
        index: group.rank(),
        count: group.size(),
    };
    Ok(EvalStage { segments, stage })
}

impl<B: KilnBackend> EvalStage<'_, B> {
    /// Hands the last stage's metrics (the only ones computed from logits) to the first stage,
    /// which reports them: `kiln launch` shows rank 0's output, as torchrun's filter does. Each
    /// value travels as its f64 bits in four 16-bit pieces (exact in f32), its name as bytes.
    fn metrics_to_first_stage(&self, out: &mut EvalOutput, device: &B::Device) -> Result<()> {
        if self.stage.count < 2 {
            return Ok(());
        }
        if self.stage.index + 1 == self.stage.count {
            let mut payload = vec![out.metrics.len() as f32];
            for (name, value) in &out.metrics {
                payload.push(name.len() as f32);
                payload.extend(name.bytes().map(f32::from));
                let bits = value.to_bits();
                payload.extend((0..4).map(|i| ((bits >> (16 * i)) & 0xffff) as f32));
            }
            let n = payload.len();
            let t = Tensor::<B, 1>::from_data(TensorData::new(payload, [n]), device);
            self.stage.group.send(t, 0)?;
        } else if self.stage.index == 0 {
            let got = self.stage.group.recv(self.stage.count - 1)?;
            let payload: Vec<f32> =
                got.into_data().convert::<f32>().to_vec().map_err(|e| {
                    KilnError::Distributed(format!("the last stage's metrics: {e:?}"))
                })?;
            let mut at = payload.iter().map(|&v| v as usize);
            let bad =
                || KilnError::Distributed("the last stage's metrics arrived cut short".into());
            let mut metrics = std::collections::BTreeMap::new();
            for _ in 0..at.next().ok_or_else(bad)? {
                let len = at.next().ok_or_else(bad)?;
                let name: Vec<u8> = at.by_ref().take(len).map(|b| b as u8).collect();
                let pieces: Vec<u64> = at.by_ref().take(4).map(|p| p as u64).collect();
                if name.len() != len || pieces.len() != 4 {
                    return Err(bad());
                }
                let bits = pieces.iter().rev().fold(0u64, |acc, p| (acc << 16) | p);
                metrics.insert(
                    String::from_utf8_lossy(&name).into_owned(),
                    f64::from_bits(bits),
                );
            }
            out.metrics = metrics;
        }
        Ok(())
    }

    /// A batch through this stage, forward only ([`crate::train::pipeline::Stage::forward_only`]).
    fn logits(&self, batch: &TokenBatch) -> Result<Option<Tensor<B, 2>>> {
        self.stage.forward_only(self.segments, batch)
    }
}
