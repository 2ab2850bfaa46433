# Sourced by demo.sh and test.sh: create .venv if needed, activate it, and define pip_install, which retries.
# Why retries: a CI run failed on a wheel download that broke off mid-file ("incomplete-download" after pip's
# own 5 resumes); a fresh attempt a few seconds later is what a person would do.
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate

pip_install() {
    local attempt
    for attempt in 1 2 3; do
        if python -m pip install -q --retries 10 --timeout 60 "$@"; then
            return 0
        fi
        echo "pip install $* failed (attempt $attempt of 3); retrying in $((attempt * 10)) s" >&2
        sleep $((attempt * 10))
    done
    return 1
}

pip_install --upgrade pip
pip_install --resume-retries 20 torch==2.13.0
