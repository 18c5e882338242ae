"""`python -m reward.grade`: the documented command; the code lives in
reward.grading.grade."""

from reward.grading.grade import main

if __name__ == "__main__":
    raise SystemExit(main())
