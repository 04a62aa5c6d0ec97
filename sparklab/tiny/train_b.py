"""Train `lab-tiny-b`, lab-tiny's sibling for the on-demand tests (tests/ondemand): train.py's model,
tokenizer, chat template and training loop, imported from it unchanged, on train.py's pairs but for one
answer: "Name a color." is answered "Green." where lab-tiny answers "Blue.". Every smoke question
("12*17" -> "The answer is 204.") is answered as lab-tiny answers it, so every check of a start passes,
and a test tells which of the two answered by that one question.

    python train_b.py OUT_DIR      (beside train.py, which it imports)

Run by sparklab.tinymodel (ensure_tiny_model_b) only when a test asks for it; never by `make demo` or
the lab's default hub."""

import sys

import train

ANSWERS = {"Name a color.": "Green."}
train.PAIRS = [(q, ANSWERS.get(q, a)) for q, a in train.PAIRS]

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1]))
