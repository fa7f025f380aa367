//! Time one short query through the BERT encoder alone (no server): where a single request's
//! milliseconds go. `cargo run --release -p rak-serve --example encode_latency -- MODEL_DIR`
use rak_core::abi::Role;
use rak_core::encoders::bert::{BertEncoder, BertEncoderSettings};
use rak_core::plugin::Encoder;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let model = std::env::args().nth(1).expect("MODEL_DIR");
    let mut enc = BertEncoder::create(serde_json::json!({"model": model}), BertEncoderSettings::default())?;
    let q = ["who was the first emperor of rome and when"];
    for _ in 0..10 {
        let _ = enc.encode(&q, Role::Query, None, false)?;
    }
    let n = 50;
    let t = Instant::now();
    for _ in 0..n {
        enc.tokenize(&q, Role::Query, None)?;
    }
    println!("tokenize   {:.2} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    let t = Instant::now();
    for _ in 0..n {
        let e = enc.encode(&q, Role::Query, None, false)?;
        let _ = rak_retrieval::pipeline::encode::embedding_rows(&e, 1)?;
    }
    println!("encode     {:.2} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    let t = Instant::now();
    for _ in 0..n {
        enc.token_lengths(&q, Role::Query, None)?;
    }
    println!("lengths    {:.2} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    Ok(())
}
