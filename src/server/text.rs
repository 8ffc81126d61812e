//! Incremental detokenization with stop strings: the text of the tokens so far, emitted as it becomes
//! final. Text that could still turn out to be the start of a stop string, or an incomplete UTF-8
//! character (a byte-level token splits one), is held back until the next tokens decide it.

use crate::model::Tokenizer;

/// Builds a request's output text from its tokens, decoding only the tokens since the last settled
/// piece (with the piece before them as context, for tokenizers whose decoding depends on it).
pub(crate) struct TextAssembler {
    tokens: Vec<u32>,
    stop: Vec<String>,
    /// The decoded text of `tokens[..settled]`.
    text: String,
    /// Tokens whose text is in `text`.
    settled: usize,
    /// The first token of the context the next decode starts from (`settled` of the push before).
    context: usize,
    /// Bytes of `text` already emitted.
    sent: usize,
    stopped: bool,
}

impl TextAssembler {
    /// An assembler that ends the text before the first of `stop`.
    pub(crate) fn new(stop: Vec<String>) -> Self {
        TextAssembler { tokens: Vec::new(), stop, text: String::new(), settled: 0, context: 0, sent: 0, stopped: false }
    }

    /// Adds `tokens`; returns the new final text and whether a stop string ended the output (then
    /// nothing more is emitted).
    pub(crate) fn push(&mut self, tokenizer: &Tokenizer, tokens: &[u32]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.tokens.extend_from_slice(tokens);
        let tail = self.decode_tail(tokenizer);
        // A trailing replacement character is an incomplete UTF-8 sequence: the next tokens finish it.
        if !tail.ends_with('\u{FFFD}') {
            self.text.push_str(&tail);
            (self.context, self.settled) = (self.settled, self.tokens.len());
        }
        if let Some(at) = self.first_stop() {
            self.stopped = true;
            return (self.emit(at), true);
        }
        let end = final_end(&self.text, &self.stop);
        (self.emit(end), false)
    }

    /// All text not yet emitted (the output ended by length or a stop token).
    pub(crate) fn flush(&mut self, tokenizer: &Tokenizer) -> String {
        if self.stopped {
            return String::new();
        }
        let tail = self.decode_tail(tokenizer);
        self.text.push_str(&tail);
        self.settled = self.tokens.len();
        self.emit(self.text.len())
    }

    /// The text of `tokens[settled..]`: the decoded context-and-tail past the decoded context.
    fn decode_tail(&self, tokenizer: &Tokenizer) -> String {
        let decode = |ids: &[u32]| tokenizer.decode(ids, true).unwrap_or_default();
        let context = decode(&self.tokens[self.context..self.settled]);
        let all = decode(&self.tokens[self.context..]);
        match all.strip_prefix(context.as_str()) {
            Some(tail) => tail.to_string(),
            // The new tokens changed how the context decodes: keep the settled text, add what follows
            // the common prefix.
            None => all.get(common_prefix_len(&context, &all)..).unwrap_or_default().to_string(),
        }
    }

    /// Where the earliest stop string starts, searching only where one could start.
    fn first_stop(&self) -> Option<usize> {
        let unsent = self.text.get(self.sent..)?;
        self.stop.iter().filter_map(|s| unsent.find(s.as_str())).min().map(|i| i + self.sent)
    }

    /// `text[sent..end]`, which is then sent.
    fn emit(&mut self, end: usize) -> String {
        let piece = self.text.get(self.sent..end.max(self.sent)).unwrap_or_default().to_string();
        self.sent += piece.len();
        piece
    }
}

/// Bytes `a` and `b` share at their start, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).take_while(|((_, x), y)| x == y).last().map_or(0, |((i, c), _)| i + c.len_utf8())
}

/// How much of `text` is final: all of it but a trailing replacement character (an incomplete UTF-8
/// sequence) and the longest tail that is a proper prefix of a stop string.
fn final_end(text: &str, stop: &[String]) -> usize {
    let end = text.strip_suffix('\u{FFFD}').map_or(text.len(), str::len);
    let body = &text[..end];
    let held = stop
        .iter()
        .flat_map(|s| s.char_indices().skip(1).map(move |(i, _)| &s[..i]))
        .filter(|prefix| body.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0);
    end - held
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped_tokenizer() -> Tokenizer {
        Tokenizer::from_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/models/tiny-k2")).unwrap()
    }

    /// Pushed one token at a time or in uneven chunks, the emitted pieces add up to the whole decode,
    /// multi-byte characters split across tokens included; no piece ends inside a character.
    #[test]
    fn pieces_add_up_to_the_whole_decode() {
        let tokenizer = shipped_tokenizer();
        let text = "Der Bär aß 12 Äpfel — naïve café, 東京 ☃.\n\nThe end.";
        let ids = tokenizer.encode(text, false).unwrap();
        let whole = tokenizer.decode(&ids, true).unwrap();
        for chunk in [1, 2, 3, 7] {
            let mut a = TextAssembler::new(Vec::new());
            let mut got = String::new();
            for piece in ids.chunks(chunk) {
                let (text, stopped) = a.push(&tokenizer, piece);
                assert!(!stopped && !text.contains('\u{FFFD}'), "chunk {chunk}: {text:?}");
                got += &text;
            }
            got += &a.flush(&tokenizer);
            assert_eq!(got, whole, "chunk {chunk}");
        }
    }

    /// A stop string split over several tokens ends the text before it, and nothing after it is sent.
    #[test]
    fn a_stop_string_across_tokens_ends_the_text() {
        let tokenizer = shipped_tokenizer();
        let ids = tokenizer.encode("It was late. The end came quickly after that.", false).unwrap();
        let mut a = TextAssembler::new(vec!["The end".into()]);
        let mut got = String::new();
        let mut stopped = false;
        for &id in &ids {
            let (text, stop) = a.push(&tokenizer, &[id]);
            got += &text;
            if stop {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(got, "It was late. ");
        assert_eq!(a.push(&tokenizer, &ids[..1]), (String::new(), true));
        assert_eq!(a.flush(&tokenizer), "");
    }

    #[test]
    fn tails_that_may_start_a_stop_string_are_held() {
        let stop = vec!["\n\nThe".to_string()];
        assert_eq!(final_end("said he.\n", &stop), "said he.".len());
        assert_eq!(final_end("said he.\n\nTh", &stop), "said he.".len());
        assert_eq!(final_end("said he. T", &stop), "said he. T".len());
        assert_eq!(final_end("abc\u{FFFD}", &[]), 3);
    }
}
