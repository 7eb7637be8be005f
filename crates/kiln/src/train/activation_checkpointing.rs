//! Activation checkpointing over a model's segments (transformers' `gradient_checkpointing_enable()`).
//!
//! A forward pass without a graph keeps only the input of every segment; then, from the top, each
//! segment (the head, each layer, the embedding) is recomputed with a graph of its own and
//! differentiated against the gradient arriving from the segment above. Every backward pass is a
//! separate one, so only one segment's activations are alive at a time: activation memory of one
//! layer instead of all, for about one more forward pass of compute.
//!
//! Burn's autodiff graph is locked while a backward pass runs, so a checkpointed segment cannot run
//! its own backward inside an outer one (what PyTorch's `checkpoint` does); this loop owns the order
//! instead. Each segment's gradients are collected by walking the whole model: parameters the
//! segment did not touch have no gradient in that pass and are skipped, so no table of which
//! parameters belong to which segment is needed.

use burn::module::AutodiffModule;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use super::optim::GradAccumulator;
use crate::ops::TrainBackend;
use crate::task::{Loss, Model};

/// Loss × `scale` and gradients of `model` on one batch, segment by segment; `None` when the model
/// is not split into segments (it then trains without checkpointing).
pub fn loss_and_grads_by_segment<B, M, L>(
    model: &M,
    batch: &M::Batch,
    targets: &[i64],
    loss_fn: &L,
    scale: f64,
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
    let mut inputs = vec![fs.embed(batch).detach()];
    for i in 0..fs.num_layers() {
        let x = inputs.last().expect("the embeddings").clone();
        inputs.push(fs.layer(i, x, batch).detach());
    }
    let mut acc = GradAccumulator::default();

    // The head and the loss.
    let h = inputs
        .pop()
        .expect("the last layer's output")
        .require_grad();
    let logits = segments.head(h.clone());
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
        let out = segments.layer(i, x.clone(), batch);
        let grads = (out * Tensor::from_inner(upstream)).sum().backward();
        acc.accumulate::<B, M>(model, &grads);
        upstream = x.grad(&grads).expect("a layer depends on its input");
    }

    // The embedding.
    let e = segments.embed(batch);
    let grads = (e * Tensor::from_inner(upstream)).sum().backward();
    acc.accumulate::<B, M>(model, &grads);
    Some((loss_value, acc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuDevice, CpuTrain};
    use crate::hub::llama_config::LlamaConfig;
    use crate::models::llama::LlamaForCausalLM;
    use crate::task::{BatchSource, CrossEntropy};

    fn host<const D: usize>(t: Tensor<Cpu, D>) -> Vec<f32> {
        t.into_data().into_vec().unwrap()
    }

    /// Checkpointed training computes the plain path's loss and every gradient, tied head or not.
    #[test]
    fn segment_by_segment_gives_the_plain_gradients() {
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
            let n = targets.len();
            let t =
                Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &d);
            let loss = CrossEntropy.loss(m.logits(&batch), t) * 0.5;
            let plain_loss = loss.clone().into_scalar().elem::<f64>();
            let mut plain = GradAccumulator::<Cpu>::default();
            plain.accumulate::<CpuTrain, _>(&m, &loss.backward());
            let (ck_loss, ck) = loss_and_grads_by_segment(&m, &batch, &targets, &CrossEntropy, 0.5)
                .expect("Llama is segmented");
            assert!(
                (ck_loss - plain_loss).abs() < 1e-6,
                "{ck_loss} vs {plain_loss}"
            );
            assert_eq!(
                ck.grads.len(),
                plain.grads.len(),
                "tie {tie}: every parameter"
            );
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
                    "tie {tie}, {name}: max |Δ| {err}"
                );
            }
        }
    }
}
