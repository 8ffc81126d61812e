//! Incremental detokenization with stop strings: the text of the tokens so far, emitted as it becomes
//! final. Text that could still turn out to be the start of a stop string, or an incomplete UTF-8
//! character (a byte-level token splits one), is held back until the next tokens decide it.

use crate::model::Tokenizer;

/// Builds a request's output text from its tokens.
pub(crate) struct TextAssembler {
    tokens: Vec<u32>,
    stop: Vec<String>,
    /// Bytes of the decoded text already emitted.
    sent: usize,
    stopped: bool,
}

impl TextAssembler {
    /// An assembler that ends the text before the first of `stop`.
    pub(crate) fn new(stop: Vec<String>) -> Self {
        TextAssembler { tokens: Vec::new(), stop, sent: 0, stopped: false }
    }

    /// Adds `tokens`; returns the new final text and whether a stop string ended the output (then
    /// nothing more is emitted).
    pub(crate) fn push(&mut self, tokenizer: &Tokenizer, tokens: &[u32]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.tokens.extend_from_slice(tokens);
        let text = tokenizer.decode(&self.tokens, true).unwrap_or_default();
        if let Some(at) = self.first_stop(&text) {
            self.stopped = true;
            return (self.emit(&text, at), true);
        }
        let end = final_end(&text, &self.stop);
        (self.emit(&text, end), false)
    }

    /// All text not yet emitted (the output ended by length or a stop token).
    pub(crate) fn flush(&mut self, tokenizer: &Tokenizer) -> String {
        if self.stopped {
            return String::new();
        }
        let text = tokenizer.decode(&self.tokens, true).unwrap_or_default();
        let end = text.len();
        self.emit(&text, end)
    }

    /// Where the earliest stop string starts, searching only where one could start.
    fn first_stop(&self, text: &str) -> Option<usize> {
        self.stop
            .iter()
            .filter_map(|s| text.get(self.sent..).and_then(|t| t.find(s.as_str())))
            .min()
            .map(|i| i + self.sent)
    }

    /// `text[sent..end]`, which is then sent.
    fn emit(&mut self, text: &str, end: usize) -> String {
        let piece = text.get(self.sent..end.max(self.sent)).unwrap_or_default().to_string();
        self.sent += piece.len();
        piece
    }
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

    #[test]
    fn tails_that_may_start_a_stop_string_are_held() {
        let stop = vec!["\n\nThe".to_string()];
        assert_eq!(final_end("said he.\n", &stop), "said he.".len());
        assert_eq!(final_end("said he.\n\nTh", &stop), "said he.".len());
        assert_eq!(final_end("said he. T", &stop), "said he. T".len());
        assert_eq!(final_end("abc\u{FFFD}", &[]), 3);
    }
}
