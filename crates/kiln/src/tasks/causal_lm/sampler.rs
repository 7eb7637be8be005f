//! How each next token is picked from a row of logits, as transformers' `generate` picks it:
//! greedy at temperature 0, else a seeded draw through its warpers in their order (temperature,
//! top-k, top-p). One value holds the settings and the random stream, as candle's
//! `LogitsProcessor` does, so decoding (whole, or a pipeline's last stage) only asks it.

use rand::{rngs::StdRng, Rng, SeedableRng};

/// Picks next tokens under one generation's settings, from one seeded stream: the same seed and
/// logits give the same tokens.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    rng: StdRng,
}

impl Sampler {
    /// Greedy at `temperature` 0, else a draw among the `top_k` most likely tokens (0: all of
    /// them), then the fewest whose probability reaches `top_p`; the stream seeded with `seed`.
    /// The ranges are the caller's to check (`GenerateOptions::check`).
    pub fn new(temperature: f64, top_k: usize, top_p: f64, seed: u64) -> Self {
        Self {
            temperature,
            top_k,
            top_p,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The next token of `logits` (one per vocabulary entry), or `None` when they are not all
    /// finite (a model with broken weights: no token is meaningful).
    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        if !logits.iter().all(|v| v.is_finite()) {
            return None;
        }
        if self.temperature <= 0.0 {
            // Greedy: ties go to the lowest id, as `torch.argmax`.
            return Some(crate::train::metrics::argmax(logits) as u32);
        }
        let probs = self.kept(logits);
        let mass: f64 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random::<f64>() * mass;
        for (id, p) in &probs {
            r -= p;
            if r <= 0.0 {
                return Some(*id);
            }
        }
        probs.last().map(|p| p.0)
    }

    /// The tokens a draw chooses among, most likely first, with their unnormalised weights
    /// `exp((logit − max) / T)`: the `top_k` most likely (all with 0), then the fewest of those
    /// whose share of the kept weight reaches `top_p`.
    fn kept(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, (((v - max) as f64) / self.temperature).exp()))
            .collect();
        // Summed in the vocabulary's order when every token stays (the same sum as before top-k
        // existed, so a seed's generation did not change with it).
        let mut total: f64 = probs.iter().map(|p| p.1).sum();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        if self.top_k > 0 && self.top_k < probs.len() {
            probs.truncate(self.top_k);
            total = probs.iter().map(|p| p.1).sum();
        }
        let mut kept = 0.0;
        let mut cut = probs.len();
        for (i, p) in probs.iter().enumerate() {
            kept += p.1 / total;
            if kept >= self.top_p {
                cut = i + 1;
                break;
            }
        }
        probs.truncate(cut);
        probs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f64, top_k: usize, top_p: f64) -> Sampler {
        Sampler::new(temperature, top_k, top_p, 3)
    }

    /// How often each token is drawn in `n` draws.
    fn frequencies(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<f64> {
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[s.sample(logits).unwrap() as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    /// softmax(logits / T) over `allowed`, 0 elsewhere: the distribution the warpers leave.
    fn expected(logits: &[f32], t: f64, allowed: &[usize]) -> Vec<f64> {
        let w: Vec<f64> = (0..logits.len())
            .map(|i| {
                if allowed.contains(&i) {
                    (f64::from(logits[i]) / t).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let sum: f64 = w.iter().sum();
        w.iter().map(|v| v / sum).collect()
    }

    /// The draws follow the analytic distribution of each setting (within 4 standard errors of
    /// 40,000 draws), and never leave the tokens top-k and top-p keep.
    #[test]
    fn draws_follow_the_warped_distribution() {
        let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0];
        let n = 40_000;
        // softmax at T = 0.7 is about [0.70, 0.17, 0.08, 0.04, 0.01]: top-p 0.9 keeps the first
        // three (0.70 + 0.17 < 0.9 ≤ + 0.08); top-k 2 the first two; both, top-p 0.85 over the
        // top-2's renormalised (0.81, 0.19), the first two; top-k 3 and top-p 0.5, the first.
        for (top_k, top_p, allowed) in [
            (0, 1.0, vec![0, 1, 2, 3, 4]),
            (0, 0.9, vec![0, 1, 2]),
            (2, 1.0, vec![0, 1]),
            (2, 0.85, vec![0, 1]),
            (3, 0.5, vec![0]),
        ] {
            let got = frequencies(&mut sampler(0.7, top_k, top_p), &logits, n);
            let want = expected(&logits, 0.7, &allowed);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let se = (w * (1.0 - w) / n as f64).sqrt();
                assert!(
                    (g - w).abs() <= 4.0 * se + 1e-12,
                    "top_k {top_k} top_p {top_p}: token {i} drawn {g}, expected {w}"
                );
            }
        }
    }

    /// Temperature 0 is argmax (ties to the lowest id); a seed repeats its draws and another
    /// seed does not; non-finite logits give no token.
    #[test]
    fn greedy_seeded_and_non_finite() {
        assert_eq!(sampler(0.0, 0, 1.0).sample(&[0.5, 3.0, 3.0, -1.0]), Some(1));
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draws = |seed| {
            let mut s = Sampler::new(1.0, 0, 1.0, seed);
            (0..20)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(1), draws(1));
        assert_ne!(draws(1), draws(2));
        assert_eq!(sampler(1.0, 0, 1.0).sample(&[0.0, f32::NAN]), None);
        assert_eq!(sampler(0.0, 0, 1.0).sample(&[f32::INFINITY, 0.0]), None);
    }
}
