//! Activation checkpointing over a model's segments (transformers' `gradient_checkpointing_enable()`).
//!
//! A forward pass without a graph keeps only the input of every segment; then, from the top, each
//! segment (the head, each layer, the embedding) is recomputed with a graph of its own and
//! differentiated against the gradient arriving from the segment above. Every backward pass is a
//! separate one, so only one segment's activations are alive at a time: activation memory of one
//! layer instead of all, for about one more forward pass of compute.
//!
//! Dropout draws its masks from a stream (`ops::dropout_position`): each recomputed segment starts
//! the stream where its first pass started it, so it sees the same masks, and the stream ends where
//! the plain forward pass would leave it. Checkpointed and plain training are the same computation.
//!
//! Burn's autodiff graph is locked while a backward pass runs, so a checkpointed segment cannot run
//! its own backward inside an outer one (what PyTorch's `checkpoint` does); this loop owns the order
//! instead. Each segment's gradients are collected by walking the whole model: parameters the
//! segment did not touch have no gradient in that pass and are skipped, so no table of which
//! parameters belong to which segment is needed.

use burn::module::AutodiffModule;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use super::optim::GradAccumulator;
use crate::contract::{Loss, Model};
use crate::ops::{dropout_position, set_dropout_position, TrainBackend};

/// Loss × `scale` and gradients of `model` on one batch and its targets, segment by segment
/// (`observe` sees the logits); `None` when the model is not split into segments (it then trains
/// without checkpointing).
pub fn loss_and_grads_by_segment<B, M, L>(
    model: &M,
    (batch, targets): (&M::Batch, &[i64]),
    loss_fn: &L,
    scale: f64,
    observe: &mut dyn FnMut(&Tensor<B, 2>),
) -> Option<(f64, GradAccumulator<B::InnerBackend>)>
where
    B: TrainBackend,
    M: Model<B> + AutodiffModule<B> + Clone,
    L: Loss,
{
    let segments = model.segments()?;
    // Inputs of every segment, from a copy whose parameters need no gradient: no graph is kept.
    let frozen = model.clone().no_grad();
    let fs = frozen.segments()?;
    // Where the dropout stream stood when each segment began: embedding, layers, head.
    let mut starts = vec![dropout_position()];
    let mut inputs = vec![fs.embed(batch).detach()];
    for i in 0..fs.num_layers() {
        starts.push(dropout_position());
        let x = inputs.last().expect("the embeddings").clone();
        inputs.push(fs.layer(i, x, batch).detach());
    }
    starts.push(dropout_position());
    let mut acc = GradAccumulator::default();

    // The head and the loss.
    let h = inputs
        .pop()
        .expect("the last layer's output")
        .require_grad();
    set_dropout_position(starts.pop().expect("the head's start"));
    let logits = segments.head(h.clone(), batch);
    observe(&logits);
    let end = dropout_position();
    let device = logits.device();
    let n = targets.len();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets.to_vec(), [n]), &device);
    let loss = loss_fn.loss(logits, targets) * scale;
    let loss_value = loss.clone().into_scalar().elem::<f64>();
    let grads = loss.backward();
    acc.accumulate::<B, M>(model, &grads);
    let mut upstream = h.grad(&grads).expect("the head depends on its input");

    // Each layer, top down: d(out · upstream)/d(params, x) is the layer's share of the gradient.
    for i in (0..segments.num_layers()).rev() {
        let x = inputs.pop().expect("one input per layer").require_grad();
        set_dropout_position(starts.pop().expect("one start per layer"));
        let out = segments.layer(i, x.clone(), batch);
        let grads = (out * Tensor::from_inner(upstream)).sum().backward();
        acc.accumulate::<B, M>(model, &grads);
        upstream = x.grad(&grads).expect("a layer depends on its input");
    }

    // The embedding.
    set_dropout_position(starts.pop().expect("the embedding's start"));
    let e = segments.embed(batch);
    let grads = (e * Tensor::from_inner(upstream)).sum().backward();
    acc.accumulate::<B, M>(model, &grads);
    set_dropout_position(end);
    Some((loss_value, acc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuDevice, CpuTrain};
    use crate::contract::{BatchSource, CrossEntropy};
    use crate::data::batch::TextBatch;
    use crate::models::bert::config::BertConfig;
    use crate::models::bert::BertForSequenceClassification;
    use crate::models::llama::config::LlamaConfig;
    use crate::models::llama::LlamaForCausalLM;
    use crate::ops::reseed_dropout;

    fn host<const D: usize>(t: Tensor<Cpu, D>) -> Vec<f32> {
        t.into_data().into_vec().unwrap()
    }

    /// Checkpointed training computes the plain path's loss and every gradient, with the same
    /// dropout masks, and leaves the dropout stream where the plain path leaves it.
    fn assert_checkpointing_matches_plain<M>(m: &M, batch: &M::Batch, targets: &[i64], what: &str)
    where
        M: Model<CpuTrain> + AutodiffModule<CpuTrain> + Clone,
    {
        let d = CpuDevice::default();
        let n = targets.len();
        reseed_dropout(11);
        let t = Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets.to_vec(), [n]), &d);
        let loss = CrossEntropy.loss(m.logits(batch), t) * 0.5;
        let plain_end = dropout_position();
        let plain_loss = loss.clone().into_scalar().elem::<f64>();
        let mut plain = GradAccumulator::<Cpu>::default();
        plain.accumulate::<CpuTrain, _>(m, &loss.backward());

        reseed_dropout(11);
        let (ck_loss, ck) =
            loss_and_grads_by_segment(m, (batch, targets), &CrossEntropy, 0.5, &mut |_| {})
                .expect("the model is segmented");
        assert_eq!(dropout_position(), plain_end, "{what}: dropout stream");
        assert!(
            (ck_loss - plain_loss).abs() < 1e-6,
            "{what}: loss {ck_loss} vs {plain_loss}"
        );
        assert_eq!(ck.grads.len(), plain.grads.len(), "{what}: every parameter");
        for (name, g) in &plain.grads {
            let (a, b) = (host(g.clone()), host(ck.grads[name].clone()));
            let err = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            let scale = a.iter().fold(0f32, |s, x| s.max(x.abs()));
            assert!(
                err <= 1e-5 * scale.max(1e-3),
                "{what}, {name}: max |Δ| {err}"
            );
        }
    }

    #[test]
    fn segment_by_segment_gives_the_plain_gradients_of_llama() {
        for tie in [true, false] {
            let c: LlamaConfig = serde_json::from_value(serde_json::json!({
                "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "initializer_range": 0.5, "tie_word_embeddings": tie}))
            .unwrap();
            let d = CpuDevice::default();
            let m = crate::ops::with_seeded_rng::<CpuTrain, _>(&d, 3, || {
                LlamaForCausalLM::<CpuTrain>::new(&c, &d)
            });
            let blocks =
                crate::data::lm::LmBlocks::pack((0..40).map(|i| (i * 7) % 50).collect(), 10, 1);
            let (batch, targets) = blocks.batch(&[2, 0, 3]);
            assert_checkpointing_matches_plain(&m, &batch, &targets, &format!("llama tie {tie}"));
        }
    }

    /// BERT with dropout everywhere (embeddings, attention, residuals, classifier), on a padded
    /// batch (packed to its real tokens) and on a full one: replaying the masks is what makes the
    /// gradients agree.
    #[test]
    fn segment_by_segment_gives_the_plain_gradients_of_bert_with_dropout() {
        let c: BertConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": 16,
            "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2,
            "initializer_range": 0.3}))
        .unwrap();
        let d = CpuDevice::default();
        let m = crate::ops::with_seeded_rng::<CpuTrain, _>(&d, 5, || {
            BertForSequenceClassification::<CpuTrain>::new(&c, 3, &d)
        });
        let lens = [6usize, 3, 5];
        let (b, t) = (lens.len(), 6);
        let mut batch = TextBatch {
            batch: b,
            seq: t,
            input_ids: (0..b * t).map(|i| (i as i64 * 5 + 1) % 40).collect(),
            attention_mask: (0..b * t).map(|i| (i % t < lens[i / t]) as i64).collect(),
            token_type_ids: (0..b * t).map(|i| (i % t >= 3) as i64).collect(),
        };
        assert_checkpointing_matches_plain(&m, &batch, &[2, 0, 1], "bert, padded");
        batch.attention_mask = vec![1; b * t];
        assert_checkpointing_matches_plain(&m, &batch, &[1, 1, 0], "bert, full");
    }
}
