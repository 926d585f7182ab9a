"""Plain English text the tiny model's tokenizer is trained on (written for this project, so
the tokenizer builds offline and identically everywhere)."""

CORPUS = """\
The river ran past the old mill at the edge of the town, and in the mornings the mist rose from
the water and hid the bridge until the sun was high. People crossed it on their way to the
market, carrying baskets of apples, bread, cheese and eggs. A baker who had lived there all his
life said that the town had changed very little in fifty years, except that the children now
left for the city and came back only in the summer.

Machines that answer questions are built from many small parts. A model reads a sequence of
tokens and predicts the next one; a server keeps many such sequences in flight at once and
shares the memory that holds their keys and values. When a request arrives, its prompt is split
into tokens, the tokens are run through the layers of the network, and the first new token is
chosen from the scores the network produced. Then the new token is fed back in, and the process
repeats until the answer is complete or a stop token appears.

Memory is the scarce resource. Every token of every sequence leaves a key and a value in every
layer, and a long conversation can hold thousands of them. If each request reserved room for the
longest answer it might ever give, most of that room would stay empty. Paging solves this: the
memory is cut into small blocks of equal size, a sequence receives a new block only when the
last one is full, and a table records which blocks belong to which sequence, in order. Two
requests that begin with the same system prompt can even share the blocks of that prompt.

The weather in the mountains is hard to predict. A clear blue sky at breakfast can turn into
rain and thunder by noon, and walkers learn to carry a warm coat, a map and enough water for the
whole day. On the high paths the air is thin and cold, and the views across the valleys are
wide: forests, lakes, villages with red roofs, and far away the grey line of the sea.

She opened the letter slowly. It was short, written in a careful hand, and it said only that the
house by the lake had been sold, that the new owners would arrive in the spring, and that the
books in the library could be collected at any time before then. She read it twice, folded it
and put it in her pocket, then went out into the garden where the roses were still in bloom.

Good software is simple to read. Each function does one thing, its name says what that thing
is, and its comments explain why it exists rather than repeating what the code already says.
Tests check the behaviour a user relies on, and they fail when that behaviour breaks. Errors
are reported with a message that tells the reader what went wrong and what to do about it.
Numbers that matter are measured, written down with the command that produced them, and
compared side by side with the alternative.

In the kitchen, the recipe called for two cups of flour, one cup of sugar, three eggs, a pinch
of salt and a spoonful of butter. Mix the dry ingredients first, then add the eggs one at a
time, and bake the cake in a warm oven for forty minutes, until a knife comes out clean. Let it
cool before you cut it, and serve it with fresh fruit or a little cream.

What is the capital of France? The capital of France is Paris. How many days are in a week?
There are seven days in a week. Who wrote the play about the prince of Denmark? It was written
by William Shakespeare. Why is the sky blue? Sunlight is scattered by the air, and blue light
is scattered more than red light, so the sky looks blue during the day.

Hello! How can I help you today? I would like to know how a train schedule works. Trains leave
the station at fixed times, and each one stops at a list of places along the line. If you know
where you start and where you want to go, you can find the first train that stops at both, and
see when it arrives. Thank you, that is very helpful. You are welcome; have a nice trip.

Numbers and symbols appear in text too: 0 1 2 3 4 5 6 7 8 9 10 100 1000, 3.14, 2026-11-30,
$20, 50%, (a + b) * c = d, x / y, "quoted words", 'single quotes', e-mail@example.com, and
lists such as one, two, three; or first: second: third. Code looks like this: def add(a, b):
return a + b. A path looks like /home/user/file.txt, and a web address like https://example.org.
"""
