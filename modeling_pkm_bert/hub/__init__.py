"""The Hub side: converting BERT/DistilBERT checkpoints to BertPkm (`conversion`), model cards, the upload list
and push, and refreshing the code files of a saved folder (`refresh`). Not imported by the remote-code files."""
