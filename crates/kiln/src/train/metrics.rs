//! Classification metrics: accuracy, precision/recall/F1 per class, macro and weighted F1
//! (scikit-learn's definitions, zero where undefined), and the confusion matrix.

use serde::Serialize;

/// Logits and true labels of an evaluation, for built-in and user-supplied metrics.
#[derive(Debug, Clone, Default)]
pub struct Predictions {
    /// `[n][num_labels]`.
    pub logits: Vec<Vec<f32>>,
    pub labels: Vec<usize>,
}

impl Predictions {
    pub fn predicted(&self) -> Vec<usize> {
        self.logits.iter().map(|row| argmax(row)).collect()
    }
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClassReport {
    pub label: String,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    pub support: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClassificationReport {
    pub accuracy: f64,
    pub f1_macro: f64,
    pub f1_weighted: f64,
    pub per_class: Vec<ClassReport>,
    /// `confusion[true][predicted]`.
    pub confusion: Vec<Vec<usize>>,
}

pub fn classification_report(
    truth: &[usize],
    predicted: &[usize],
    label_names: &[String],
) -> ClassificationReport {
    let n = label_names.len();
    let mut confusion = vec![vec![0usize; n]; n];
    for (&t, &p) in truth.iter().zip(predicted) {
        confusion[t][p] += 1;
    }
    let total = truth.len().max(1) as f64;
    let correct: usize = (0..n).map(|c| confusion[c][c]).sum();
    let per_class: Vec<ClassReport> = (0..n)
        .map(|c| {
            let tp = confusion[c][c] as f64;
            let support: usize = confusion[c].iter().sum();
            let predicted_c: usize = (0..n).map(|r| confusion[r][c]).sum();
            let precision = if predicted_c > 0 {
                tp / predicted_c as f64
            } else {
                0.0
            };
            let recall = if support > 0 {
                tp / support as f64
            } else {
                0.0
            };
            let f1 = if precision + recall > 0.0 {
                2.0 * precision * recall / (precision + recall)
            } else {
                0.0
            };
            ClassReport {
                label: label_names[c].clone(),
                precision,
                recall,
                f1,
                support,
            }
        })
        .collect();
    let f1_macro = per_class.iter().map(|c| c.f1).sum::<f64>() / n.max(1) as f64;
    let f1_weighted = per_class
        .iter()
        .map(|c| c.f1 * c.support as f64)
        .sum::<f64>()
        / total;
    ClassificationReport {
        accuracy: correct as f64 / total,
        f1_macro,
        f1_weighted,
        per_class,
        confusion,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_scikit_learn_on_a_small_case() {
        // sklearn.metrics.f1_score([0,0,1,1,2,2,2],[0,1,1,1,2,0,2], average=...) →
        // macro 0.7, weighted 0.7142857; accuracy 5/7.
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let r = classification_report(&[0, 0, 1, 1, 2, 2, 2], &[0, 1, 1, 1, 2, 0, 2], &names);
        assert!((r.accuracy - 5.0 / 7.0).abs() < 1e-12);
        assert!((r.f1_macro - 0.7).abs() < 1e-9, "{}", r.f1_macro);
        assert!(
            (r.f1_weighted - 0.714_285_714_3).abs() < 1e-9,
            "{}",
            r.f1_weighted
        );
        assert_eq!(
            r.confusion,
            vec![vec![1, 1, 0], vec![0, 2, 0], vec![1, 0, 2]]
        );
    }
}
