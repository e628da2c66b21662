# Sourced by .ci/run and tests/run_tests.sh: find_python X.Y prints an interpreter of that version.
# pyenv's shims follow .python-version (3.12 here), so a 3.11 request goes to pyenv's install first.
find_python() {
  local want=$1 root cand
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in "$root"/versions/"$want"*/bin/python"$want" "$(command -v python"$want" 2>/dev/null)"; do
    if [ -x "$cand" ] && "$cand" -c "import venv, sys; assert sys.version_info[:2] == tuple(map(int, '$want'.split('.')))" 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "no Python $want interpreter found (install it with pyenv)" >&2
  return 1
}
