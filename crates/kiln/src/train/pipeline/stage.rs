//! One optimizer step's micro-batches on one pipeline stage: the forwards and backwards of the
//! schedule (`parallel::pipeline::stage_actions`, 1F1B or GPipe), in its order, over the layers
//! this stage holds, with activations handed forward and their gradients back over the pipeline
//! group's point-to-point links.
//!
//! The model is cut with the same `Segments` activation checkpointing runs (embedding, layers,
//! head): a stage's forward of micro-batch `j` starts from the embedding (stage 0) or from the
//! hidden states stage `s − 1` sent, runs its layers, and ends in the head and the loss (the last
//! stage) or sends its output on. Its backward differentiates that piece against the gradient
//! stage `s + 1` sent back (the last stage: against its loss), which is activation
//! checkpointing's way of differentiating one segment alone, and sends the input's gradient to
//! stage `s − 1`. A micro-batch's graph lives from its forward to its backward, so a stage holds
//! at most as many as the schedule keeps in flight (1F1B: the stages after it, plus one).
//!
//! A tied embedding and head (SmolLM2) is one parameter on two stages: stage 0 uses it as the
//! embedding and the last stage as the head. After the last backward their two gradients are
//! summed, stage 0's first on both, so both copies take the same update and stay equal.
//!
//! Hand-overs carry the tensor's dimensions before its values (`parallel::pipeline::wire`), so
//! a stage needs no shape of its own for what arrives (packed and padded batches alike).
//!
//! With activation checkpointing (`--gradient-checkpointing`) a forward runs without a graph and
//! a micro-batch leaves only its stage input in flight; its backward first runs the stage's
//! layers again from that input, with a graph and the dropout stream where the first pass had it,
//! then differentiates as above. The values, and so the gradients, are the same bits.

use burn::module::AutodiffModule;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use crate::contract::{Loss, Model, Segments};
use crate::ops::{dropout_position, set_dropout_position, TrainBackend};
use crate::parallel::pipeline::{hand_over, receive};
use crate::parallel::pipeline::{stage_actions, Action, ScheduleKind, StageCut};
use crate::parallel::Collectives;
use crate::train::optim::GradAccumulator;
use crate::{KilnError, Result};

/// This rank's place in its pipeline: stage `index` of `count`, the layers (and the embedding or
/// head) it holds, and the pipeline group, in which stage `s` is rank `s`.
pub struct Stage<'c, B: burn::tensor::backend::Backend> {
    pub index: usize,
    pub count: usize,
    pub cut: StageCut,
    pub group: &'c dyn Collectives<B>,
}

impl<B: crate::ops::KilnBackend> Stage<'_, B> {
    /// A batch through this stage, forward only: from the embedding or the previous stage's
    /// hidden states, through its layers, to the next stage (`None`) or, on the last stage, to
    /// the head's output (evaluation, and DPO's reference pass).
    pub fn forward_only<Batch>(
        &self,
        segments: &dyn Segments<B, Batch>,
        batch: &Batch,
    ) -> Result<Option<Tensor<B, 2>>> {
        let mut x = match self.cut.embedding {
            true => segments.embed(batch),
            false => receive(self.group, self.index - 1)?,
        };
        for i in self.cut.layers.clone() {
            x = segments.layer(i, x, batch);
        }
        if self.cut.head {
            return Ok(Some(segments.head(x, batch)));
        }
        hand_over(self.group, x, self.index + 1)?;
        Ok(None)
    }
}

/// What a micro-batch leaves on this stage between its forward and its backward.
struct InFlight<B: TrainBackend> {
    /// The hidden states that arrived (stages after the first): their gradient goes back.
    input: Option<Tensor<B, 3>>,
    /// The stage's output to differentiate (before the last stage), or the scaled loss; `None`
    /// under activation checkpointing (recomputed from `input` at the backward).
    graph: Option<(Tensor<B, 3>, Option<Tensor<B, 1>>)>,
    /// Where the dropout stream stood when the forward began.
    dropout_start: u64,
}

/// A micro-batch's mean loss of its logits and targets.
type LossOf<'a, B> = &'a dyn Fn(Tensor<B, 2>, Tensor<B, 1, Int>) -> Tensor<B, 1>;

/// The last stage's look at a micro-batch's head output and its targets (a training metric's
/// sums), once per micro-batch.
pub type Observe<'a, B> = &'a mut dyn FnMut(&Tensor<B, 2>, &[i64]);

/// The stage's part of micro-batch `j` on `segments` from `input` (`None`: the embedding): its
/// output, and on the last stage its loss × `scale` (the head's output seen by `observe`).
fn stage_forward<B: TrainBackend, Batch>(
    segments: &dyn Segments<B, Batch>,
    cut: &StageCut,
    (batch, targets): &(Batch, Vec<i64>),
    input: Option<Tensor<B, 3>>,
    (loss_fn, scale): (LossOf<'_, B>, f64),
    observe: Option<Observe<'_, B>>,
) -> (Tensor<B, 3>, Option<Tensor<B, 1>>) {
    let mut x = match input {
        Some(x) => x,
        None => segments.embed(batch),
    };
    for i in cut.layers.clone() {
        x = segments.layer(i, x, batch);
    }
    if !cut.head {
        return (x, None);
    }
    let logits = segments.head(x.clone(), batch);
    if let Some(observe) = observe {
        observe(&logits, targets);
    }
    let device = logits.device();
    let t =
        Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [targets.len()]), &device);
    let loss = loss_fn(logits, t) * scale;
    (x, Some(loss))
}

/// What one step of a stage gave.
pub struct StageStep<B: burn::tensor::backend::Backend> {
    /// The summed scaled loss (the last stage's; 0 on the others).
    pub loss_sum: f64,
    /// The gradients of the parameters this stage used.
    pub grads: GradAccumulator<B>,
    /// The step's wall time on this stage, and the part of it spent waiting for a neighbour's
    /// hand-over (the pipeline's bubble, plus the transfers).
    pub seconds: f64,
    pub waited: f64,
}

/// Runs this stage's share of one step: `micro` are the step's micro-batches with their targets,
/// `scales` what each micro-batch's mean loss is multiplied by; `checkpointing` recomputes each
/// micro-batch's activations at its backward instead of keeping them. On the last stage
/// `observe` sees each micro-batch's head output once (not again where it is recomputed).
pub fn stage_loss_and_grads<B, M, L>(
    model: &M,
    micro: &[(M::Batch, Vec<i64>)],
    scales: &[f64],
    loss_fn: &L,
    (kind, checkpointing): (ScheduleKind, bool),
    stage: &Stage<'_, B::InnerBackend>,
    observe: Observe<'_, B>,
) -> Result<StageStep<B::InnerBackend>>
where
    B: TrainBackend,
    M: Model<B> + AutodiffModule<B> + Clone,
    L: Loss,
{
    let unsplit = || {
        KilnError::Config(
            "pipeline parallelism cuts a model at its layers, and this model is not split into layers"
                .into(),
        )
    };
    let segments = model.segments().ok_or_else(unsplit)?;
    // Under checkpointing the forwards run on a copy whose parameters need no gradient.
    let frozen = checkpointing.then(|| model.clone().no_grad());
    let forward_segments = match &frozen {
        Some(f) => f.segments().ok_or_else(unsplit)?,
        None => segments,
    };
    let loss_of = |logits, t| loss_fn.loss(logits, t);
    let (me, last) = (stage.index, stage.count - 1);
    let started = std::time::Instant::now();
    let mut waited = 0.0;
    let mut timed_receive = |from: usize| {
        let t = std::time::Instant::now();
        let got = receive(stage.group, from);
        waited += t.elapsed().as_secs_f64();
        got
    };
    let mut in_flight: Vec<Option<InFlight<B>>> = (0..micro.len()).map(|_| None).collect();
    let mut acc = GradAccumulator::default();
    let mut loss_sum = 0.0;
    for action in stage_actions(kind, stage.count, me, micro.len()) {
        match action {
            Action::Forward(j) => {
                let dropout_start = dropout_position();
                let input = if stage.cut.embedding {
                    None
                } else {
                    let x = Tensor::<B, 3>::from_inner(timed_receive(me - 1)?);
                    Some(if checkpointing { x } else { x.require_grad() })
                };
                let (x, loss) = stage_forward(
                    forward_segments,
                    &stage.cut,
                    &micro[j],
                    input.clone(),
                    (&loss_of, scales[j]),
                    Some(&mut *observe),
                );
                match &loss {
                    Some(l) => loss_sum += l.clone().into_scalar().elem::<f64>(),
                    None => hand_over(stage.group, x.clone().inner(), me + 1)?,
                }
                in_flight[j] = Some(InFlight {
                    input,
                    graph: (!checkpointing).then_some((x, loss)),
                    dropout_start,
                });
            }
            Action::Backward(j) => {
                let mut f = in_flight[j]
                    .take()
                    .expect("the schedule runs a micro-batch's forward before its backward");
                let (output, loss) = match f.graph {
                    Some(graph) => graph,
                    None => {
                        // Recomputed with a graph, the dropout stream where the forward had it;
                        // the stream then goes on from where it was.
                        let now = dropout_position();
                        set_dropout_position(f.dropout_start);
                        f.input = f.input.map(Tensor::require_grad);
                        let again = stage_forward(
                            segments,
                            &stage.cut,
                            &micro[j],
                            f.input.clone(),
                            (&loss_of, scales[j]),
                            None,
                        );
                        set_dropout_position(now);
                        again
                    }
                };
                let grads = match loss {
                    Some(loss) => loss.backward(),
                    None => {
                        let upstream = timed_receive(me + 1)?;
                        (output * Tensor::from_inner(upstream)).sum().backward()
                    }
                };
                acc.accumulate::<B, M>(model, &grads);
                if let Some(x) = f.input {
                    let g = x
                        .grad(&grads)
                        .expect("a stage's output depends on its input");
                    hand_over(stage.group, g, me - 1)?;
                }
            }
        }
    }
    if last > 0 {
        let t = std::time::Instant::now();
        sum_tied_gradients(&mut acc, &model.embedding_parameters(), stage)?;
        waited += t.elapsed().as_secs_f64();
    }
    Ok(StageStep {
        loss_sum,
        grads: acc,
        seconds: started.elapsed().as_secs_f64(),
        waited,
    })
}

/// Sums the gradients of parameters held on both the first and the last stage (a tied embedding
/// and head): the last stage sends each of `names` it has a gradient for (an empty tensor for one
/// it has not), stage 0 adds its own first and sends the sum back. Both then hold the same sum.
fn sum_tied_gradients<B: burn::tensor::backend::Backend>(
    acc: &mut GradAccumulator<B>,
    names: &[String],
    stage: &Stage<'_, B>,
) -> Result<()> {
    let last = stage.count - 1;
    let device = stage.group.device().clone();
    if stage.index == last {
        for name in names {
            let g = acc
                .grads
                .get(name)
                .cloned()
                .unwrap_or_else(|| Tensor::<B, 1>::zeros([0], &device));
            let tied = g.dims()[0] > 0;
            stage.group.send(g, 0)?;
            if tied {
                acc.grads.insert(name.clone(), stage.group.recv(0)?);
            }
        }
    } else if stage.index == 0 {
        for name in names {
            let theirs = stage.group.recv(last)?;
            if theirs.dims()[0] == 0 {
                continue;
            }
            let sum = match acc.grads.get(name) {
                Some(mine) => mine.clone() + theirs,
                None => theirs,
            };
            stage.group.send(sum.clone(), last)?;
            acc.grads.insert(name.clone(), sum);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuDevice, CpuTrain};
    use crate::contract::{BatchSource, CrossEntropy};
    use crate::models::llama::config::LlamaConfig;
    use crate::models::llama::LlamaForCausalLM;
    use crate::parallel::pipeline::cut_stages;
    use crate::parallel::threads::ThreadComm;
    use std::collections::BTreeMap;

    fn llama(layers: usize, tie: bool) -> LlamaForCausalLM<CpuTrain> {
        let c: LlamaConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "initializer_range": 0.5, "tie_word_embeddings": tie}))
        .unwrap();
        let d = CpuDevice::default();
        crate::ops::with_seeded_rng::<CpuTrain, _>(&d, 3, || {
            LlamaForCausalLM::<CpuTrain>::new(&c, &d)
        })
    }

    type Micro = Vec<(
        <LlamaForCausalLM<CpuTrain> as Model<CpuTrain>>::Batch,
        Vec<i64>,
    )>;

    fn micro_batches(m: usize) -> Micro {
        let blocks = crate::data::lm::LmBlocks::pack(
            (0..400u32).map(|i| (i * 7 + i / 9) % 50).collect(),
            9,
            1,
        );
        (0..m).map(|j| blocks.batch(&[2 * j, 2 * j + 1])).collect()
    }

    fn host(t: Tensor<Cpu, 1>) -> Vec<f32> {
        t.into_data().into_vec().unwrap()
    }

    /// The gradients of the whole model, one process, micro-batch after micro-batch.
    fn reference(
        layers: usize,
        tie: bool,
        micro: &Micro,
        scales: &[f64],
    ) -> (f64, BTreeMap<String, Vec<f32>>) {
        let m = llama(layers, tie);
        let d = CpuDevice::default();
        let mut acc = GradAccumulator::<Cpu>::default();
        let mut loss_sum = 0.0;
        for ((batch, targets), s) in micro.iter().zip(scales) {
            let t = Tensor::<CpuTrain, 1, Int>::from_data(
                TensorData::new(targets.clone(), [targets.len()]),
                &d,
            );
            let loss = CrossEntropy.loss(m.logits(batch), t) * *s;
            loss_sum += loss.clone().into_scalar().elem::<f64>();
            acc.accumulate::<CpuTrain, _>(&m, &loss.backward());
        }
        (
            loss_sum,
            acc.grads.into_iter().map(|(k, v)| (k, host(v))).collect(),
        )
    }

    /// Every stage of a `stages`-stage pipeline, one thread each; returns each stage's loss and
    /// gradients.
    fn pipeline(
        layers: usize,
        tie: bool,
        stages: usize,
        kind: (ScheduleKind, bool),
        micro: &Micro,
        scales: &[f64],
    ) -> Vec<(f64, BTreeMap<String, Vec<f32>>)> {
        let cuts = cut_stages(layers, stages, None).unwrap();
        let comms = ThreadComm::<Cpu>::group(stages, &CpuDevice::default());
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .zip(cuts)
                .enumerate()
                .map(|(index, (comm, cut))| {
                    s.spawn(move || {
                        let m = llama(layers, tie);
                        let stage = Stage {
                            index,
                            count: stages,
                            cut,
                            group: &comm,
                        };
                        let mut ignore = |_: &Tensor<CpuTrain, 2>, _: &[i64]| {};
                        let got = stage_loss_and_grads(
                            &m,
                            micro,
                            scales,
                            &CrossEntropy,
                            kind,
                            &stage,
                            &mut ignore,
                        )
                        .unwrap();
                        assert!(got.waited <= got.seconds);
                        (
                            got.loss_sum,
                            got.grads
                                .grads
                                .into_iter()
                                .map(|(k, v)| (k, host(v)))
                                .collect(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = a.iter().fold(1e-3f32, |s, x| s.max(x.abs()));
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
            / scale
    }

    /// Every parameter's gradient comes from exactly one stage (a tied embedding from the first
    /// and the last, equal there), equal to the single-process gradient, and the last stage's
    /// loss is the single-process loss: 5 layers over 2 stages (3|2 with the embedding and head
    /// counted) and over 4, tied and untied, 1F1B and GPipe, 1 to 6 micro-batches.
    #[test]
    fn every_stage_layout_gives_the_single_process_loss_and_gradients() {
        for (stages, m, tie, kind) in [
            (2, 4, true, ScheduleKind::OneFOneB),
            (2, 1, false, ScheduleKind::OneFOneB),
            (4, 6, true, ScheduleKind::OneFOneB),
            (4, 3, false, ScheduleKind::GPipe),
            (3, 2, true, ScheduleKind::GPipe),
        ] {
            let what = format!("PP={stages}, {m} micro-batches, tied {tie}, {kind:?}");
            let micro = micro_batches(m);
            let scales: Vec<f64> = (0..m).map(|j| 1.0 / m as f64 + 0.01 * j as f64).collect();
            let (want_loss, want) = reference(5, tie, &micro, &scales);
            let got = pipeline(5, tie, stages, (kind, false), &micro, &scales);
            // Activation checkpointing recomputes the same values: the same bits.
            let again = pipeline(5, tie, stages, (kind, true), &micro, &scales);
            assert!(again == got, "{what}: checkpointed stages differ");
            let loss = got[stages - 1].0;
            assert!(
                (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
                "{what}: loss {loss} vs {want_loss}"
            );
            assert!(
                got[..stages - 1].iter().all(|(l, _)| *l == 0.0),
                "{what}: loss only on the last stage"
            );
            for (name, g) in &want {
                let holders: Vec<usize> = (0..stages)
                    .filter(|&s| got[s].1.contains_key(name))
                    .collect();
                let tied = tie && name == "model.embed_tokens.weight";
                let expected = if tied {
                    vec![0, stages - 1]
                } else {
                    vec![holders[0]]
                };
                assert_eq!(holders, expected, "{what}: who holds {name}");
                for &s in &holders {
                    let err = max_rel(g, &got[s].1[name]);
                    assert!(err <= 1e-5, "{what}: {name} on stage {s}: rel {err}");
                }
            }
            let total: usize = got.iter().map(|(_, g)| g.len()).sum();
            assert_eq!(
                total,
                want.len() + usize::from(tie),
                "{what}: no extra gradients"
            );
        }
    }

    /// The control: a pipeline over another model's weights differs from the reference, so the
    /// comparison above can fail.
    #[test]
    fn a_different_model_differs() {
        let micro = micro_batches(2);
        let (want_loss, _) = reference(5, true, &micro, &[0.5, 0.5]);
        let got = pipeline(
            4,
            false,
            2,
            (ScheduleKind::OneFOneB, false),
            &micro,
            &[0.5, 0.5],
        );
        assert!(
            (got[1].0 - want_loss).abs() > 1e-3,
            "{} vs {want_loss}",
            got[1].0
        );
    }
}
