//! Learning-rate schedules.

/// Linear warm-up from 0 to the peak over `warmup` steps, then linear decay to 0 at `total`
/// (Hugging Face's `get_linear_schedule_with_warmup`). `step` counts steps already taken, so
/// the first update uses `factor(0)`.
pub fn linear_warmup_decay(step: u64, total: u64, warmup: u64) -> f64 {
    if step < warmup {
        return step as f64 / warmup.max(1) as f64;
    }
    (total.saturating_sub(step) as f64 / total.saturating_sub(warmup).max(1) as f64).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_like_transformers() {
        assert_eq!(linear_warmup_decay(0, 100, 10), 0.0);
        assert_eq!(linear_warmup_decay(5, 100, 10), 0.5);
        assert_eq!(linear_warmup_decay(10, 100, 10), 1.0);
        assert_eq!(linear_warmup_decay(55, 100, 10), 0.5);
        assert_eq!(linear_warmup_decay(100, 100, 10), 0.0);
        assert_eq!(linear_warmup_decay(3, 100, 0), 0.97);
    }
}
