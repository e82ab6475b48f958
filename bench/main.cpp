// The lintape command-line tool.
#include <cstdio>
int main() { return 0; }
