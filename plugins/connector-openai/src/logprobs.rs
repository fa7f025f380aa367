//! Log-probabilities as servers return them, read into one form.
//!
//! - OpenAI's legacy completions shape: `choices[0].logprobs = {tokens, token_logprobs,
//!   top_logprobs: [{token: logprob}], text_offset}` (vLLM's `/v1/completions` too, which also
//!   echoes the prompt's tokens with `echo: true`).
//! - The chat shape: `choices[0].logprobs.content = [{token, logprob, top_logprobs: [{token,
//!   logprob}]}]`, which llama.cpp and Ollama return even from `/v1/completions`.
//! - vLLM's `prompt_logprobs`: `choices[0].prompt_logprobs = [null, {"<token id>": {logprob,
//!   rank, decoded_token}}, ...]`, one entry per prompt token, each holding that token.
//! - llama.cpp's native `/completion`: `completion_probabilities = [{id, token, logprob,
//!   top_logprobs}]`.

use serde_json::Value;

/// One generated position: the token taken and the top alternatives (the taken one included).
#[derive(Debug, Clone, PartialEq)]
pub struct Position {
    pub token: String,
    pub logprob: f64,
    pub top: Vec<(String, f64)>,
}

/// The generated positions of a `/v1/completions` or `/v1/chat/completions` reply, in
/// whichever shape it came; `None` when it carries no log-probabilities.
pub fn generated_positions(reply: &Value) -> Option<Vec<Position>> {
    let lp = &reply["choices"][0]["logprobs"];
    if let Some(content) = lp["content"].as_array() {
        return Some(content.iter().map(chat_position).collect());
    }
    let tokens = lp["tokens"].as_array()?;
    let values = lp["token_logprobs"].as_array()?;
    let tops = lp["top_logprobs"].as_array();
    Some(
        tokens
            .iter()
            .zip(values)
            .enumerate()
            .map(|(i, (t, v))| {
                let token = t.as_str().unwrap_or("").to_string();
                let logprob = v.as_f64().unwrap_or(f64::NEG_INFINITY);
                let mut top: Vec<(String, f64)> = tops
                    .and_then(|ts| ts.get(i))
                    .and_then(Value::as_object)
                    .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect())
                    .unwrap_or_default();
                top.push((token.clone(), logprob));
                Position { token, logprob, top }
            })
            .collect(),
    )
}

fn chat_position(p: &Value) -> Position {
    let token = p["token"].as_str().unwrap_or("").to_string();
    let logprob = p["logprob"].as_f64().unwrap_or(f64::NEG_INFINITY);
    let mut top: Vec<(String, f64)> = p["top_logprobs"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| Some((t["token"].as_str()?.to_string(), t["logprob"].as_f64()?))).collect())
        .unwrap_or_default();
    top.push((token.clone(), logprob));
    Position { token, logprob, top }
}

/// The generated text of a completions or chat reply.
pub fn generated_text(reply: &Value) -> Option<String> {
    let c = &reply["choices"][0];
    c["text"].as_str().or_else(|| c["message"]["content"].as_str()).map(str::to_string)
}

/// Log-probabilities of candidate next tokens (answer letters) from one position's top list.
/// A candidate's spellings with and without leading white space (`A`, ` A`) are the same
/// answer: their probabilities are added. A candidate missing from the list gets `floor`
/// (by default the list's lowest value, an upper bound on the missing one) and is marked.
pub fn candidate_logprobs(top: &[(String, f64)], candidates: &[String], floor: Option<f64>) -> (Vec<f64>, Vec<bool>, f64) {
    let mut seen: Vec<(String, f64)> = Vec::new();
    // The taken token is listed twice when the top list holds it too; count each spelling once.
    for (t, v) in top {
        if !seen.iter().any(|(s, _)| s == t) {
            seen.push((t.clone(), *v));
        }
    }
    let floor = floor.unwrap_or_else(|| seen.iter().map(|(_, v)| *v).filter(|v| v.is_finite()).fold(f64::INFINITY, f64::min));
    let floor = if floor.is_finite() { floor } else { -100.0 };
    let mut values = Vec::with_capacity(candidates.len());
    let mut floored = Vec::with_capacity(candidates.len());
    for c in candidates {
        let hits: Vec<f64> = seen.iter().filter(|(t, _)| t.trim_start() == c.trim_start()).map(|(_, v)| *v).collect();
        if hits.is_empty() {
            values.push(floor);
            floored.push(true);
        } else {
            values.push(log_sum_exp(&hits));
            floored.push(false);
        }
    }
    (values, floored, floor)
}

/// Index of the most likely candidate among those in the top list; `None` when none is (the
/// model's next token is not an answer letter, e.g. "The" on a chat endpoint).
pub fn best_candidate(values: &[f64], floored: &[bool]) -> Option<usize> {
    (0..values.len())
        .filter(|&i| !floored[i]).max_by(|&a, &b| (!floored[a], values[a]).partial_cmp(&(!floored[b], values[b])).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(&a)))
}

fn log_sum_exp(xs: &[f64]) -> f64 {
    let m = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// The echoed prompt's per-token log-probabilities of a legacy-shape reply to a request with
/// `echo: true`: `(token, logprob, text offset in characters)`. `None` when the server did
/// not echo (llama.cpp accepts the flag and ignores it).
pub fn echoed_tokens(reply: &Value) -> Option<Vec<(String, Option<f64>, usize)>> {
    let lp = &reply["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array()?;
    let values = lp["token_logprobs"].as_array()?;
    let offsets = lp["text_offset"].as_array()?;
    if tokens.len() != values.len() || tokens.len() != offsets.len() {
        return None;
    }
    tokens
        .iter()
        .zip(values)
        .zip(offsets)
        .map(|((t, v), o)| Some((t.as_str()?.to_string(), v.as_f64(), o.as_u64()? as usize)))
        .collect()
}

/// log P(continuation | prompt) from echoed tokens: the sum over the tokens that start inside
/// the continuation (`prompt_chars..end_chars`). Fails when a token straddles the boundary,
/// since its probability belongs to neither part alone.
pub fn continuation_from_echo(tokens: &[(String, Option<f64>, usize)], prompt_chars: usize, end_chars: usize) -> Result<(f64, usize), String> {
    let mut sum = 0.0;
    let mut n = 0;
    for (t, v, off) in tokens {
        let end = off + t.chars().count();
        if *off < prompt_chars && end > prompt_chars {
            return Err(format!("the token {t:?} spans the end of the prompt; end the prompt on a token boundary (e.g. before a space)"));
        }
        if *off >= prompt_chars && *off < end_chars {
            sum += v.ok_or_else(|| format!("no log-probability for the continuation token {t:?}"))?;
            n += 1;
        }
    }
    if n == 0 {
        return Err("the echo holds no token of the continuation".into());
    }
    Ok((sum, n))
}

/// log P(continuation | prompt) from vLLM's `prompt_logprobs` (one entry per token of the whole
/// text, the first null): the sum, over the positions past the prompt's own tokens, of the
/// log-probability of the token the whole text has there. Fails when the whole text's tokens
/// do not start with the prompt's (a token straddles the boundary) or the lengths disagree.
pub fn continuation_from_prompt_logprobs(positions: &[Value], prompt_ids: &[i64], full_ids: &[i64]) -> Result<(f64, usize), String> {
    if positions.len() != full_ids.len() {
        return Err(format!("prompt_logprobs lists {} positions, but /tokenize makes {} tokens of the text", positions.len(), full_ids.len()));
    }
    if !full_ids.starts_with(prompt_ids) {
        return Err("the text's tokens do not start with the prompt's: a token spans the end of the prompt; end the prompt on a token boundary (e.g. before a space)".into());
    }
    if full_ids.len() == prompt_ids.len() {
        return Err("the continuation adds no token".into());
    }
    let mut sum = 0.0;
    for (i, id) in full_ids.iter().enumerate().skip(prompt_ids.len()) {
        let entry = &positions[i][id.to_string()];
        sum += entry["logprob"]
            .as_f64()
            .or_else(|| entry.as_f64())
            .ok_or_else(|| format!("prompt_logprobs position {i} has no log-probability for token {id}"))?;
    }
    Ok((sum, full_ids.len() - prompt_ids.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_legacy_shape() {
        let r = json!({"choices": [{"text": " B", "logprobs": {"tokens": [" B"], "token_logprobs": [-0.5],
            "top_logprobs": [{" B": -0.5, " A": -1.5, "A": -3.0}], "text_offset": [10]}}]});
        let p = generated_positions(&r).unwrap();
        assert_eq!(p[0].token, " B");
        let (v, f, _) = candidate_logprobs(&p[0].top, &["A".into(), "B".into(), "C".into()], None);
        assert!((v[0] - (( -1.5f64).exp() + (-3.0f64).exp()).ln()).abs() < 1e-12);
        assert_eq!(v[1], -0.5);
        assert_eq!(f, vec![false, false, true]);
        assert_eq!(v[2], -3.0, "the floor is the lowest listed value");
        assert_eq!(best_candidate(&v, &f), Some(1));
        assert_eq!(generated_text(&r).as_deref(), Some(" B"));
    }

    #[test]
    fn reads_the_chat_shape() {
        let r = json!({"choices": [{"text": "A", "logprobs": {"content": [{"token": "A", "logprob": -0.1,
            "top_logprobs": [{"token": "A", "logprob": -0.1}, {"token": " C", "logprob": -2.5}]}]}}]});
        let p = generated_positions(&r).unwrap();
        let (v, f, floor) = candidate_logprobs(&p[0].top, &["A".into(), "B".into(), "C".into()], Some(-50.0));
        assert_eq!((v[0], v[1], v[2]), (-0.1, -50.0, -2.5));
        assert_eq!(f, vec![false, true, false]);
        assert_eq!(floor, -50.0);
        let chat = json!({"choices": [{"message": {"content": "Paris"}}]});
        assert_eq!(generated_text(&chat).as_deref(), Some("Paris"));
        assert!(generated_positions(&chat).is_none());
    }

    #[test]
    fn floored_candidates_lose_ties() {
        assert_eq!(best_candidate(&[-3.0, -3.0], &[true, false]), Some(1));
        assert_eq!(best_candidate(&[-3.0, -3.0], &[true, true]), None);
    }

    #[test]
    fn sums_the_continuation_from_an_echo() {
        // "The capital is" + " Lisbon": offsets in characters.
        let r = json!({"choices": [{"logprobs": {"tokens": ["The", " capital", " is", " Lis", "bon", "."],
            "token_logprobs": [null, -5.0, -1.0, -2.0, -0.25, -1.0], "text_offset": [0, 3, 11, 14, 18, 21]}}]});
        let t = echoed_tokens(&r).unwrap();
        assert_eq!(continuation_from_echo(&t, 14, 21).unwrap(), (-2.25, 2));
        assert!(continuation_from_echo(&t, 16, 21).is_err(), "a token across the boundary is refused");
    }

    #[test]
    fn sums_the_continuation_from_prompt_logprobs() {
        // vLLM's shape: a map per position keyed by token id, the prompt's own token included
        // (here with a top-1 alternative beside it).
        let positions = json!([null,
            {"791": {"logprob": -5.0, "rank": 40, "decoded_token": " capital"}, "13": {"logprob": -1.0, "rank": 1, "decoded_token": ","}},
            {"374": {"logprob": -1.0, "rank": 1, "decoded_token": " is"}},
            {"41395": {"logprob": -2.0, "rank": 3, "decoded_token": " Lis"}, "12366": {"logprob": -0.5, "rank": 1, "decoded_token": " Paris"}},
            {"9186": {"logprob": -0.25, "rank": 1, "decoded_token": "bon"}}]);
        let positions = positions.as_array().unwrap();
        let full = [464, 791, 374, 41395, 9186];
        assert_eq!(continuation_from_prompt_logprobs(positions, &full[..3], &full).unwrap(), (-2.25, 2));
        assert!(continuation_from_prompt_logprobs(positions, &[464, 791, 999], &full).unwrap_err().contains("spans the end"));
        assert!(continuation_from_prompt_logprobs(&positions[..4], &full[..3], &full).unwrap_err().contains("4 positions"));
        assert!(continuation_from_prompt_logprobs(positions, &full, &full).is_err());
    }
}
